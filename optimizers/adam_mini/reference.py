"""Pure PyTorch Adam-mini step: the CPU path and the oracle the Triton kernel is checked against.

With fp32 momentum the math and its order are adam-mini 1.1.1's (Zhang et al. 2024), per
block B of the partition, with g the gradient, t the step after the increment:

    v_B = b2 * v_B + (1 - b2) * mean_{i in B}(g_i^2)         (per element for plain-Adam biases)
    p   = p * (1 - lr * wd)                                   (if the parameter decays)
    m   = lerp(m, g, 1 - b1)
    h_B = sqrt(v_B) / sqrt(1 - b2^t) + eps
    p   = p - lr * m * ((1 / (1 - b1^t)) / h_B)               (biases: p - (lr / (1-b1^t)) * m / h)

Math runs in fp32 whatever the parameter dtype. bf16 momentum is rounded when stored; FP8
momentum is stored through ``fp8.quantize_``; the update always uses this step's
unrounded m. This path may synchronise with the host (boolean indexing); the kernel does not.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .fp8 import dequantize, quantize_
from .partition import ParamPartition


def block_mean_sq(g: Tensor, part: ParamPartition) -> Tensor:
    """mean(g^2) over each block of ``part``: fp32 (blocks,). ``g`` is fp32 (rows, cols)."""
    sq = g * g
    means = [sq[s.start : s.start + s.count].reshape(s.blocks, -1).mean(dim=1) for s in part.segments]
    return torch.cat(means) if len(means) > 1 else means[0]


def _read_momentum(state: dict, rows: int, cols: int, step: int) -> Tensor:
    m = state["exp_avg"]
    if m.dtype == torch.float8_e4m3fn:
        return dequantize(state, rows, cols, read_half=(step - 1) % 2)
    return m.view(rows, cols).float()


def adam_mini_reference_step(
    p: Tensor, grad: Tensor, state: dict, part: ParamPartition, *, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float,
) -> dict[str, Tensor]:
    """Update ``p`` (any float dtype) and its ``state`` in place. Returns this step's telemetry:
    ``bf16_blocks`` and ``overflow`` (FP8 sub-blocks), ``amax_update``: the largest |Adam update|
    lr * m_hat / (sqrt(v_hat) + eps) of any element (the decoupled weight decay left out)."""
    rows, cols = part.rows, part.cols
    step = int(state["step"].item()) + 1
    g = grad.detach().reshape(rows, cols).float()  # a copy where p is not contiguous (channels_last)
    x = p.detach().reshape(rows, cols).float()
    v = state["exp_avg_sq"]
    if part.kind == "adam":
        v.view(rows, cols).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        v.mul_(beta2).add_(block_mean_sq(g, part), alpha=1 - beta2)
    if weight_decay > 0.0 and part.weight_decay:
        x.mul_(1 - lr * weight_decay)
    m = _read_momentum(state, rows, cols, step).lerp_(g, 1 - beta1)
    bc1, bc2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
    if part.kind == "adam":
        h = (v.view(rows, cols).sqrt() / bc2_sqrt).add_(eps)
        x.addcdiv_(m, h, value=-lr / bc1)
        amax_update = _max_abs(m / h) * (lr / bc1)
    else:
        h = (v.sqrt() / bc2_sqrt).add_(eps)
        per_row = torch.repeat_interleave((1 / bc1) / h, torch.tensor(_rows_per_block(part), device=h.device))
        update = m * per_row[:, None] * lr
        x.sub_(update)
        amax_update = _max_abs(update)
    telemetry = {"bf16_blocks": torch.zeros((), dtype=torch.int64, device=p.device)}
    telemetry["overflow"] = telemetry["bf16_blocks"].clone()
    stored = state["exp_avg"]
    if stored.dtype == torch.float8_e4m3fn:
        telemetry["bf16_blocks"], telemetry["overflow"] = quantize_(state, m, write_half=step % 2)
    else:
        stored.view(rows, cols).copy_(m)
    p.detach().copy_(x.view(p.shape))
    telemetry["amax_update"] = amax_update
    state["step"].add_(1)
    return telemetry


def _max_abs(t: Tensor) -> Tensor:
    return t.abs().max() if t.numel() else torch.zeros((), device=t.device)


def _rows_per_block(part: ParamPartition) -> list[int]:
    return [s.rows_per_block for s in part.segments for _ in range(s.blocks)]
