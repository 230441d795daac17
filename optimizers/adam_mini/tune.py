"""The Adam-mini tuning workloads: a whole AdamMini step on the 134M Llama-style list.

Used by ``python -m kernel_factory.optimizers.tune --families adam_mini``. A trial configures
every launch plan of the step (the decaying and the non-decaying group), checks one step
against the pure-PyTorch reference on fresh gradients, and times the step as users call it.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import ADAM_MINI

from ..parity import compare_tensors
from ..shared.tuning import InPlaceTask
from ..shared.workloads import SHAPE_SETS
from .fp8 import dequantize
from .optimizer import AdamMini
from .reference import adam_mini_reference_step

# Normwise relative error of one step against the reference: fp32 rounding, and for bf16
# parameters one flipped 8-bit rounding per element at most (see tests/test_adam_mini_gpu.py).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GEOMETRY = dict(dim=768, n_heads=12)  # the llama134m list's attention geometry


class AdamMiniTuningTask(InPlaceTask):
    """One AdamMini step (param dtype, momentum dtype) on the 134M list as a tuner task."""

    family = ADAM_MINI

    def __init__(self, dtype: torch.dtype, momentum: str, device: str, bandwidth_tbs: float | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(seed)
        named = [(n, torch.randn(s, device=device, dtype=dtype, generator=gen) * 0.02)
                 for n, s in SHAPE_SETS["llama134m"]]  # fmt: skip
        self.params = [p for _, p in named]
        for p in self.params:
            p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen)
        self.opt = AdamMini(named, lr=1e-3, weight_decay=0.1, momentum_dtype=momentum, **GEOMETRY)
        self.opt.step()  # builds the plans and the state
        self.plans = [pl for _, pls, _ in self.opt._plans.values() for pl in pls]
        if not self.plans:
            raise RuntimeError("AdamMini tuning needs the Triton path (a CUDA GPU)")
        self.variant = ADAM_MINI.tuning_key(self.plans[0].variant)
        self.dtype = self.plans[0].variant["param_dtype"]
        numel = sum(p.numel() for p in self.params)
        self.numel = numel
        state = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values())
        moved = numel * 3 * dtype.itemsize + 2 * state  # p read + write, g read; state read + write
        self.floor_ms = moved / (bandwidth_tbs * 1e12) * 1e3 if bandwidth_tbs else None
        self.tol = TOL[dtype]
        self.snapshot([*self.params, *(t for s in self.opt.state.values() for t in s.values())])

    def configure(self, config) -> None:
        for plan in self.plans:
            plan.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        torch.cuda.synchronize()

    def run(self) -> None:
        self.opt.step()

    def check(self) -> float:
        """Worst normwise relative error (params, momentum) of one step against the reference."""
        self.restore()
        for p in self.params:
            p.grad.normal_()
        opt, group = self.opt, self.opt.param_groups
        ref = {p: ({k: v.clone() for k, v in opt.state[p].items()}, p.detach().clone()) for p in self.params}
        for g in group:
            for p in g["params"]:
                state, x = ref[p]
                adam_mini_reference_step(x, p.grad, state, opt._parts[id(p)], lr=g["lr"], beta1=g["betas"][0],
                                         beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"])  # fmt: skip
        self.run()
        torch.cuda.synchronize()
        errors = []
        for p in self.params:
            state, x = ref[p]
            errors.append(compare_tensors("p", "check", p, x, self.tol).rel)
            # Momentum may differ by a flipped FP8 rounding (2^-3 of an element): allowed 100x.
            m_err = compare_tensors("p", "m", _momentum(opt, p, opt.state[p]), _momentum(opt, p, state), 1.0).rel
            errors.append(m_err / 100)
            if "exp_avg_scale" in state:
                # Sub-blocks sent to the bf16 fallback, as a fraction of all: a last-bit difference
                # may flip a rare one; a kernel that rounds FP8 wrongly sends most of them.
                ours, theirs = (int((s["exp_avg_scale"] < 0).sum()) for s in (opt.state[p], state))
                errors.append(abs(ours - theirs) / state["exp_avg_scale"].numel())
        self.restore()
        return max(e if math.isfinite(e) else math.inf for e in errors)


def _momentum(opt: AdamMini, p: torch.Tensor, state: dict) -> torch.Tensor:
    if state["exp_avg"].dtype != torch.float8_e4m3fn:
        return state["exp_avg"].float()
    part = opt._parts[id(p)]
    return dequantize(state, part.rows, part.cols, read_half=int(state["step"]) % 2)


def adam_mini_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[AdamMiniTuningTask]:
    """FP8 momentum for each parameter dtype, and fp32 momentum for fp32 parameters."""
    tasks = []
    for dname in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
        tasks.append(AdamMiniTuningTask(dtype, "fp8", device, bandwidth_tbs))
        if dtype == torch.float32:
            tasks.append(AdamMiniTuningTask(dtype, "fp32", device, bandwidth_tbs))
    return tasks
