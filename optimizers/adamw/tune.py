"""The AdamW tuning workloads: for each dtype and each of the family's tune sizes, a real launch
plan (the 134M Llama-style list at the 2^27 bucket, one tensor below it) checked against the
pure-PyTorch reference. Used by ``python -m kernel_factory.optimizers.tune --families adamw``.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import ADAMW, size_bucket

from ..parity import compare_tensors
from ..shared.tuning import InPlaceTask
from ..shared.workloads import SHAPE_SETS
from .optimizer import AdamW
from .plan import Hyper, TritonBucket
from .reference import adam_reference_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Normwise tolerance of the parity gate: fp32 differs from the reference by rounding only;
# bf16/fp16 storage rounds each step to 8/11 bits (see parity/matrix.py).
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def shapes_for(numel: int) -> list[tuple[int, ...]]:
    """The workload at a tune size: the 134M list for its bucket, else one tensor."""
    llama = [s for _, s in SHAPE_SETS["llama134m"]]
    if size_bucket(sum(math.prod(s) for s in llama)) == numel:
        return llama
    return [(numel // 1024, 1024)] if numel >= 1024 else [(numel,)]


class AdamWTuningTask(InPlaceTask):
    """One AdamW launch plan (param dtype, state dtype, size) as a tuner task."""

    family = ADAMW

    def __init__(self, shapes, dtype: torch.dtype, device: str, state_dtype: str | None = None,
                 bandwidth_tbs: float | None = None, seed: int = 0) -> None:  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(seed)
        self.params = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
        for p in self.params:
            p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen)
        self.opt = AdamW(self.params, lr=1e-3, weight_decay=0.01, state_dtype=state_dtype)
        self.opt.step()  # builds the plan and the state
        (self.bucket,) = [b for plan in self.opt._plans.values() for b in plan.buckets]
        if not isinstance(self.bucket, TritonBucket):
            raise RuntimeError("AdamW tuning needs the Triton path (CUDA, or TRITON_INTERPRET=1 with "
                               "KERNEL_FACTORY_BACKEND=triton)")  # fmt: skip
        self.hyper = Hyper(self.opt.param_groups[0])
        self.variant = ADAMW.tuning_key(ADAMW.variant(**self.bucket._variant))
        self.dtype = self.bucket._variant["param_dtype"]
        self.numel = size_bucket(sum(p.numel() for p in self.params))
        state_bytes = self.bucket.exp_avgs[0].element_size()
        moved = sum(p.numel() for p in self.params) * (3 * dtype.itemsize + 4 * state_bytes)
        self.floor_ms = moved / (bandwidth_tbs * 1e12) * 1e3 if bandwidth_tbs else None
        self.tol = TOL[dtype]
        self.snapshot(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        b = self.bucket
        return [*b.params, *b.exp_avgs, *b.exp_avg_sqs, *b.max_exp_avg_sqs, b.steps]

    def configure(self, config) -> None:
        self.bucket.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        self._sync()

    def run(self) -> None:
        self.bucket.run(self.hyper, None, None)

    def check(self) -> float:
        """Worst normwise relative error of one launch against the reference, on fresh grads."""
        self.restore()
        for p in self.params:
            p.grad.normal_()
        b, h = self.bucket, self.hyper
        ref_p, ref_m, ref_v, ref_vmax = ([t.clone() for t in ts] for ts in
                                         (b.params, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs))  # fmt: skip
        ref_steps = [b.steps[i].clone() for i in range(len(b.params))]
        adam_reference_step(ref_p, [p.grad for p in b.params], ref_m, ref_v, ref_vmax, ref_steps, lr=h.lr,
                            beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                            decoupled=h.decoupled, amsgrad=h.amsgrad, maximize=h.maximize)  # fmt: skip
        self.run()
        self._sync()
        pairs = [*zip(b.params, ref_p, strict=True), *zip(b.exp_avgs, ref_m, strict=True)]
        error = max(compare_tensors("t", "check", out, ref, self.tol).rel for out, ref in pairs)
        self.restore()
        return error

    def _sync(self) -> None:
        if self.params[0].is_cuda:
            torch.cuda.synchronize()


def adamw_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[AdamWTuningTask]:
    """The AdamW keys: each dtype x tune size with state in the parameter dtype, and bf16/fp16
    parameters with fp32 state."""
    tasks = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for numel in ADAMW.tune_sizes:
            shapes = shapes_for(numel)
            tasks.append(AdamWTuningTask(shapes, dtype, device, bandwidth_tbs=bandwidth_tbs))
            if dtype != torch.float32:
                tasks.append(AdamWTuningTask(shapes, dtype, device, state_dtype="fp32", bandwidth_tbs=bandwidth_tbs))
    return tasks
