"""Pure PyTorch reference of the fused Adam/AdamW step.

It is the ``KERNEL_FACTORY_BACKEND=torch`` path and the oracle the kernels are
checked against. Math runs in fp32 (fp64 for fp64 tensors) and the order of
operations is the kernel template's (kernel_templates/adamw.py.j2), which
follows torch's fused Adam. No host synchronisation: a step skipped because of
``found_inf`` is selected with ``torch.where``, not branched on.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor


def adam_reference_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Update ``params`` and their state in place, one tensor at a time.

    Every list holds one entry per parameter (``max_exp_avg_sqs`` may be empty
    unless ``amsgrad``); ``steps`` are 0-d float tensors, incremented here.
    Param/grad dtypes fp16/bf16/fp32/fp64; state tensors any float dtype.
    """
    for i, p in enumerate(params):
        math_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        f = partial(Tensor.to, dtype=math_dtype)
        g = f(grads[i])
        if grad_scale is not None:
            g = g * (1.0 / f(grad_scale))
        if maximize:
            g = -g
        pv, m, v = f(p), f(exp_avgs[i]), f(exp_avg_sqs[i])
        lr_t = f(torch.as_tensor(lr, device=p.device))
        step = steps[i] + 1
        if weight_decay != 0:
            if decoupled:
                pv = pv * (1 - lr_t * weight_decay)
            else:
                g = g + weight_decay * pv
        m = m + (1 - beta1) * (g - m)  # torch's lerp form
        v = beta2 * v + (1 - beta2) * g * g
        # Bias corrections in fp64 (1 - b^t cancels: fp32 would lose a digit at t=1).
        step64 = step.double()
        step_size = f(lr_t.double() / (1 - beta1**step64))
        bc2_sqrt = f(torch.sqrt(1 - beta2**step64))
        if amsgrad:
            vmax = torch.maximum(f(max_exp_avg_sqs[i]), v)
            denom = vmax.sqrt() / bc2_sqrt + eps
        else:
            denom = v.sqrt() / bc2_sqrt + eps
        pv = pv - step_size * m / denom
        updates = [(p, pv), (exp_avgs[i], m), (exp_avg_sqs[i], v), (steps[i], step)]
        if amsgrad:
            updates.append((max_exp_avg_sqs[i], vmax))
        for dst, new in updates:
            if found_inf is not None:
                new = torch.where(found_inf.to(dst.device) != 0, f(dst), new)
            dst.copy_(new)
