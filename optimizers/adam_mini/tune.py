"""The Adam-mini tuning workloads: a whole AdamMini step on the parameter list of a model at each
of the family's tune sizes (the 134M Llama-style list at 2^27, Qwen2.5-0.5B at 2^29, four layers of
Llama-2-7B at 2^30, Llama-3.2-1B at 2^31), with the model's attention geometry.

Used by ``python -m kernel_factory.optimizers.tune --families adam_mini``. A trial configures
every launch plan of the step (the decaying and the non-decaying group), checks one step
against the pure-PyTorch reference on fresh gradients, and times the step as users call it. A
task allocates its model when first used and frees it in ``release()``, after its study.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import ADAM_MINI, size_bucket

from ..parity import relative_error
from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES
from ..shared.tuning import ModelWorkloadTask
from ..shared.workloads import MODELS, SHAPE_SETS, model_at
from .fp8 import dequantize
from .optimizer import AdamMini
from .plan import MOMENTUM_TRITON
from .reference import adam_mini_reference_step

# Normwise relative error of one step against the reference: fp32 rounding, and for bf16
# parameters one flipped 8-bit rounding per element at most (see tests/test_adam_mini_gpu.py).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
MOMENTUM = {"fp8": torch.float8_e4m3fn, "fp32": torch.float32}


class AdamMiniTuningTask(ModelWorkloadTask):
    """One AdamMini step (param dtype, momentum dtype) on a model's parameter list as a tuner task."""

    family = ADAM_MINI
    WORKLOAD = (*ModelWorkloadTask.WORKLOAD, "plans")
    plans: list = []

    def __init__(self, model: str, dtype: torch.dtype, momentum: str, device: str,
                 bandwidth_tbs: float | None = None, seed: int = 0) -> None:  # fmt: skip
        self.model, self.param_dtype, self.momentum, self.device = model, dtype, momentum, device
        self.bandwidth_tbs, self.seed = bandwidth_tbs, seed
        # The cache key, known before anything is allocated (the plan's own is checked at build).
        self.variant = ADAM_MINI.tuning_key(ADAM_MINI.variant(
            multi_tensor=torch.device(device).type == "cuda", param_dtype=TRITON_DTYPES[dtype],
            momentum=MOMENTUM_TRITON[MOMENTUM[momentum]]))  # fmt: skip
        self.dtype = TRITON_DTYPES[dtype]
        self.numel = size_bucket(sum(math.prod(s) for _, s in SHAPE_SETS[model]))
        self.tol = TOL[dtype]

    def allocate(self) -> None:
        """Allocate params, grads and the optimizer; build its plans and state with one step."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        dtype, config = self.param_dtype, MODELS[self.model]
        named = [(n, torch.randn(s, device=self.device, dtype=dtype, generator=gen) * 0.02)
                 for n, s in SHAPE_SETS[self.model]]  # fmt: skip
        self.params = [p for _, p in named]
        for p in self.params:
            p.grad = torch.randn(p.shape, device=self.device, dtype=dtype, generator=gen)
        self.opt = AdamMini(named, lr=1e-3, weight_decay=0.1, momentum_dtype=self.momentum, dim=config["dim"],
                            n_heads=config["n_heads"], n_kv_heads=config.get("n_kv_heads"))  # fmt: skip
        self.opt.step()  # builds the plans and the state
        self.plans = [pl for _, pls, _ in self.opt._plans.values() for pl in pls]
        if not self.plans:
            raise RuntimeError("AdamMini tuning needs the Triton path (a CUDA GPU)")
        self.expect_variant(ADAM_MINI, self.plans[0].variant)
        numel = sum(p.numel() for p in self.params)
        state = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values())
        moved = numel * 3 * dtype.itemsize + 2 * state  # p read + write, g read; state read + write
        self.floor_ms = moved / (self.bandwidth_tbs * 1e12) * 1e3 if self.bandwidth_tbs else None
        self.snapshot([*self.params, *(t for s in self.opt.state.values() for t in s.values())])

    def precompile(self, configs) -> None:
        """Compile ``configs``' update kernels on background threads, in parallel, and return when
        they are done (the tuner's compile-ahead: a config compiles two or three variants of
        seconds each); the plans stay on their config."""
        self.ensure()
        warms = [w for config in configs for plan in self.plans for w in plan.warm_config(config)]
        precompile.wait_all(warms)

    def configure(self, config) -> None:
        self.ensure()
        for plan in self.plans:
            plan.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        torch.cuda.synchronize()

    def run(self) -> None:
        self.ensure()
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
            errors.append(relative_error(p, x))
            # Momentum may differ by a flipped FP8 rounding (2^-3 of an element): allowed 100x.
            m_err = relative_error(_momentum(opt, p, opt.state[p]), _momentum(opt, p, state))
            errors.append(m_err / 100)
            if "exp_avg_scale" in state:
                # Sub-blocks sent to the bf16 fallback, as a fraction of all: a last-bit difference
                # may flip a rare one; a kernel that rounds FP8 wrongly sends most of them.
                ours, theirs = (int((s["exp_avg_scale"] < 0).sum()) for s in (opt.state[p], state))
                errors.append(abs(ours - theirs) / state["exp_avg_scale"].numel())
        self.restore()
        return max(errors)  # relative_error gives inf, never NaN, for a non-finite result


def _momentum(opt: AdamMini, p: torch.Tensor, state: dict) -> torch.Tensor:
    if state["exp_avg"].dtype != torch.float8_e4m3fn:
        return state["exp_avg"].float()
    part = opt._parts[id(p)]
    return dequantize(state, part.rows, part.cols, read_half=int(state["step"]) % 2)


def adam_mini_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[AdamMiniTuningTask]:
    """At each tune size: FP8 momentum for each parameter dtype, and fp32 momentum for fp32 parameters."""
    tasks = []
    for numel in ADAM_MINI.tune_sizes:
        model = model_at(ADAM_MINI, numel)
        for dname in dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
            tasks.append(AdamMiniTuningTask(model, dtype, "fp8", device, bandwidth_tbs))
            if dtype == torch.float32:
                tasks.append(AdamMiniTuningTask(model, dtype, "fp32", device, bandwidth_tbs))
    return tasks
