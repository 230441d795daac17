"""The Adafactor tuning workloads: the parameter list of the model at each of the family's tune
sizes (``workloads.model_at_bucket``) in each param dtype, with 8-bit and fp32 statistics, each
launch checked against the PyTorch path. A task allocates its model when first used and frees it
after its study. Used by ``python -m kernel_factory.optimizers.tune --families adafactor``.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import ADAFACTOR, size_bucket

from ..parity import relative_error
from ..shared.buckets import TRITON_DTYPES
from ..shared.tuning import ModelWorkloadTask
from ..shared.workloads import SHAPE_SETS, model_at
from .optimizer import Adafactor, ReferenceAdafactor
from .plan import AdafactorLaunch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Normwise tolerance after one launch against the PyTorch path in fp32 on the same values: on the
# params' change for fp32 params (sums in another order, the GPU's approximate rsqrt: a few ulps),
# on the params for bf16 / fp16 ones (one rounding of the param: 2^-8, 2^-11 relative at most).
TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-3, torch.float16: 5e-4}
CODE_FLIPS = 1e-3  # fraction of all code bytes allowed to differ from the PyTorch path's
STATE_CODECS = {8: "log8", 32: "fp32"}  # state_bits -> the family's state_codec axis


class AdafactorTuningTask(ModelWorkloadTask):
    """The fused launches of one param dtype and state codec on a model's parameter list as a tuner task."""

    family = ADAFACTOR
    WORKLOAD = (*ModelWorkloadTask.WORKLOAD, "launch", "group")

    def __init__(self, dtype: torch.dtype, state_bits: int, device: str, bandwidth_tbs: float | None = None,
                 seed: int = 0, model: str = "llama134m") -> None:  # fmt: skip
        self.param_dtype, self.state_bits, self.device, self.seed, self.model = dtype, state_bits, device, seed, model
        self.variant = ADAFACTOR.tuning_key(ADAFACTOR.variant(
            multi_tensor=torch.device(device).type == "cuda", state_codec=STATE_CODECS[state_bits]))  # fmt: skip
        self.dtype = TRITON_DTYPES[dtype]
        numel = sum(math.prod(s) for _, s in SHAPE_SETS[model])
        self.numel = size_bucket(numel)
        # three passes: g read three times, p read twice and written once (the statistics are noise)
        self.floor_ms = numel * 6 * dtype.itemsize / (bandwidth_tbs * 1e12) * 1e3 if bandwidth_tbs else None
        self.tol = TOL[dtype]

    def allocate(self) -> None:
        """Allocate params, grads and the optimizer; build its plan with one step."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        dtype = self.param_dtype
        self.params = [torch.nn.Parameter((torch.randn(s, device=self.device, generator=gen) * 0.02).to(dtype))
                       for _, s in SHAPE_SETS[self.model]]  # fmt: skip
        for p in self.params:
            p.grad = torch.randn(p.shape, device=self.device, generator=gen).to(dtype)
        self.opt = Adafactor(self.params, lr=1e-2, weight_decay=0.01, state_bits=self.state_bits)
        self.opt.step()  # builds the plan
        (plan,) = self.opt._plans.values()
        if len(plan.launches) != 1 or plan.reference:
            raise RuntimeError("Adafactor tuning needs the fused path for every tensor (CUDA)")
        self.launch: AdafactorLaunch = plan.launches[0]
        self.group = self.opt.param_groups[0]
        self.expect_variant(ADAFACTOR, ADAFACTOR.variant(**self.launch.variant))
        self.snapshot(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        states = [t for s in self.launch.states for k, t in s.items() if k != "step"]
        return [*self.launch.params, *states, self.launch.steps]

    def configure(self, config) -> None:
        self.ensure()
        self.launch.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        self._sync()

    def run(self) -> None:
        self.ensure()
        self.launch.run(self.group, None, None)

    def check(self) -> float:
        """Worst normwise relative error of the params' change after one launch against the
        PyTorch path (inf if more than CODE_FLIPS of all codes differ), on fresh grads."""
        self.restore()
        for p in self.params:
            p.grad.normal_()
        copies = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        ref = ReferenceAdafactor(copies, **{k: v for k, v in self.group.items() if k != "params"})
        for q, p in zip(copies, self.params, strict=True):
            q.grad = p.grad.float()
            ref.state[q].update({k: t.float() if t.is_floating_point() and t.dim() else t.clone()
                                 for k, t in self.opt.state[p].items()})  # fmt: skip
        before = [p.detach().float() for p in self.params]
        ref.step()
        self.run()
        self._sync()
        error, flips, codes = 0.0, 0, 0
        for p, q, p0 in zip(self.params, copies, before, strict=True):
            if p.dtype == torch.float32:
                error = max(error, relative_error(p - p0, q - p0))
            else:
                error = max(error, relative_error(p, q))
            for key, t in self.opt.state[p].items():
                if t.dtype == torch.uint8:
                    flips += int((t != ref.state[q][key]).sum())
                    codes += t.numel()
        self.restore()
        # over all codes: one flip in a statistic of 768 values is expected now and then
        return float("inf") if flips > CODE_FLIPS * codes else error

    def _sync(self) -> None:
        if self.params[0].is_cuda:
            torch.cuda.synchronize()


def adafactor_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[AdafactorTuningTask]:
    """The Adafactor keys: each tune size's model x dtype x state codec."""
    return [AdafactorTuningTask(DTYPES[d], bits, device, bandwidth_tbs, model=model_at(ADAFACTOR, numel))
            for numel in ADAFACTOR.tune_sizes for d in dtypes for bits in STATE_CODECS]  # fmt: skip
