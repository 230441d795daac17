"""The AdamW tuning workloads: for each dtype and each of the family's tune sizes, a real launch
plan (the parameter list of a model at its bucket: the 134M Llama-style list at 2^27, Qwen2.5-0.5B
at 2^29, four layers of Llama-2-7B at 2^30, Llama-3.2-1B at 2^31; one tensor at other sizes)
checked against the pure-PyTorch reference. Used by ``python -m kernel_factory.optimizers.tune
--families adamw``. A task allocates its tensors when first used and frees them in ``release()``,
which the tuner calls after its study: the largest hold tens of gigabytes.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import ADAMW, size_bucket

from ..parity import relative_error
from ..shared.buckets import TRITON_DTYPES
from ..shared.tuning import ModelWorkloadTask
from ..shared.workloads import SHAPE_SETS, model_at_bucket
from .optimizer import AdamW
from .plan import Hyper, TritonBucket
from .reference import adam_reference_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Normwise tolerance of the parity gate: fp32 differs from the reference by rounding only;
# bf16/fp16 storage rounds each step to 8/11 bits (see parity/matrix.py).
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def shapes_for(numel: int) -> list[tuple[int, ...]]:
    """The workload at a tune size: the model list of that bucket, else one tensor."""
    model = model_at_bucket(numel)
    if model is not None:
        return [s for _, s in SHAPE_SETS[model]]
    return [(numel // 1024, 1024)] if numel >= 1024 else [(numel,)]


class AdamWTuningTask(ModelWorkloadTask):
    """One AdamW launch plan (param dtype, state dtype, size) as a tuner task."""

    family = ADAMW
    WORKLOAD = (*ModelWorkloadTask.WORKLOAD, "bucket", "hyper", "_looked_up")
    bucket: TritonBucket | None = None

    def __init__(self, shapes, dtype: torch.dtype, device: str, state_dtype: str | None = None,
                 bandwidth_tbs: float | None = None, seed: int = 0) -> None:  # fmt: skip
        self.shapes, self.param_dtype, self.device = [tuple(s) for s in shapes], dtype, device
        self.state_dtype, self.seed = state_dtype, seed
        # The cache key, known before anything is allocated (the bucket's own is checked at build).
        state = torch.float32 if state_dtype == "fp32" else dtype
        self.variant = ADAMW.tuning_key(ADAMW.variant(multi_tensor=torch.device(device).type == "cuda",
                                                      param_dtype=TRITON_DTYPES[dtype],
                                                      state_dtype=TRITON_DTYPES[state]))  # fmt: skip
        self.dtype = TRITON_DTYPES[dtype]
        total = sum(math.prod(s) for s in self.shapes)
        self.numel = size_bucket(total)
        moved = total * (3 * dtype.itemsize + 4 * state.itemsize)
        self.floor_ms = moved / (bandwidth_tbs * 1e12) * 1e3 if bandwidth_tbs else None
        self.tol = TOL[dtype]

    def allocate(self) -> None:
        """Allocate params, grads and the optimizer; build its plan and state with one step."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        dtype = self.param_dtype
        self.params = [torch.randn(s, device=self.device, dtype=dtype, generator=gen) for s in self.shapes]
        for p in self.params:
            p.grad = torch.randn(p.shape, device=self.device, dtype=dtype, generator=gen)
        self.opt = AdamW(self.params, lr=1e-3, weight_decay=0.01, state_dtype=self.state_dtype)
        self.opt.step()  # builds the plan and the state
        (bucket,) = [b for plan in self.opt._plans.values() for b in plan.buckets]
        if not isinstance(bucket, TritonBucket):
            raise RuntimeError("AdamW tuning needs the Triton path (CUDA, or TRITON_INTERPRET=1 with "
                               "KERNEL_FACTORY_BACKEND=triton)")  # fmt: skip
        self.expect_variant(ADAMW, ADAMW.variant(**bucket._variant))
        self.bucket, self.hyper = bucket, Hyper(self.opt.param_groups[0])
        self._looked_up = dict(bucket.config)
        self.snapshot(self._tensors())

    def looked_up_config(self) -> dict:
        """The config the optimizer's cache lookup gave this workload (allocates it)."""
        self.ensure()
        return self._looked_up

    def _tensors(self) -> list[torch.Tensor]:
        b = self.bucket
        return [*b.params, *b.exp_avgs, *b.exp_avg_sqs, *b.max_exp_avg_sqs, b.steps]

    def configure(self, config) -> None:
        self.ensure()
        self.bucket.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        self._sync()

    def run(self) -> None:
        self.ensure()
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
        error = max(relative_error(out, ref) for out, ref in pairs)
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
