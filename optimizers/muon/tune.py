"""The Muon elementwise tuning workloads: the kernels around NS on the hidden matrices of the model
at each of the family's tune sizes (``workloads.model_at_bucket(hidden=True)``: the 134M list at
2^27, Qwen2.5-0.5B at 2^29, Llama-3.2-1B at 2^30); a task allocates them when first used and frees
them after its study.

Used by ``python -m kernel_factory.optimizers.tune --families muon``. A trial times the momentum,
normalize and update kernels of every NS batch (NS itself is the newton_schulz family's), and
checks a whole Muon step against torch's multi-tensor path on fresh gradients.
"""

from __future__ import annotations

import math

import torch

from kernel_factory.generator import MUON, size_bucket

from ..parity import relative_error
from ..shared.buckets import TRITON_DTYPES
from ..shared.tuning import ModelWorkloadTask
from ..shared.workloads import SHAPE_SETS, hidden_matrices, model_at
from .optimizer import Muon
from .plan import MuonHyper, TorchBatch, TritonBatch

# Normwise, one step: NS in bf16 on inputs that may differ by the Frobenius norm's summation
# order (one bf16 rounding of a matrix's norm); bf16 params also round their update to 8 bits.
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
# Bytes per parameter the kernels move: g (read), buf (read, write), X bf16 (write), O bf16
# (read), p (read, write); NS divides X by its norm on the fly (newton_schulz_launch.py).
_BF16_BYTES = 2 + 2


class MuonTuningTask(ModelWorkloadTask):
    """The Muon kernels of one param dtype on the hidden matrices of a model's parameter list."""

    family = MUON
    WORKLOAD = (*ModelWorkloadTask.WORKLOAD, "batches", "hyper", "bufs")

    def __init__(self, dtype: torch.dtype, device: str, bandwidth_tbs: float | None = None, seed: int = 0,
                 model: str = "llama134m") -> None:  # fmt: skip
        self.param_dtype, self.device, self.seed = dtype, device, seed
        self.shapes = [s for _, s in hidden_matrices(SHAPE_SETS[model])]
        self.variant = MUON.tuning_key(MUON.variant(multi_tensor=True))
        self.dtype = TRITON_DTYPES[dtype]
        numel = sum(math.prod(s) for s in self.shapes)
        self.numel = size_bucket(numel)
        moved = numel * (5 * dtype.itemsize + _BF16_BYTES)  # g; buf and p read and written
        self.floor_ms = moved / (bandwidth_tbs * 1e12) * 1e3 if bandwidth_tbs else None
        self.tol = TOL[dtype]

    def allocate(self) -> None:
        """Allocate params, grads and the optimizer; build its plan and buffers with one step."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.params = [(torch.randn(s, device=self.device, generator=gen) * 0.02).to(self.param_dtype)
                       for s in self.shapes]  # fmt: skip
        for p in self.params:
            p.grad = torch.randn(p.shape, device=self.device, generator=gen).to(self.param_dtype)
        self.opt = Muon(self.params, lr=0.02, weight_decay=0.1)
        self.opt.step()  # builds the plan and the momentum buffers
        self.batches = [b for plan in self.opt._plans.values() for b in plan.batches]
        if not all(isinstance(b, TritonBatch) and b.multi_tensor for b in self.batches):
            raise RuntimeError("Muon tuning needs the multi-tensor Triton path (a CUDA GPU)")
        self.expect_variant(MUON, MUON.variant(**self.batches[0]._variant))
        self.hyper = MuonHyper(self.opt.param_groups[0])
        self.bufs = [self.opt.state[p]["momentum_buffer"] for p in self.params]
        self.snapshot([*self.params, *self.bufs])

    def configure(self, config) -> None:
        self.ensure()
        for b in self.batches:
            b.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        torch.cuda.synchronize()

    def run(self) -> None:
        """The kernels without NS: X stands in for O (the timing does not depend on values)."""
        self.ensure()
        for b in self.batches:
            b.apply(self.hyper, b.prepare(self.hyper))

    def check(self) -> float:
        """Worst normwise relative error of one Muon step (params, buffers) against torch's ops."""
        self.restore()
        for p in self.params:
            p.grad.normal_()
        ref_p = [p.detach().clone() for p in self.params]
        ref_bufs = [b.clone() for b in self.bufs]
        index = {id(p): i for i, p in enumerate(self.params)}
        for b in self.batches:
            idx = [index[id(p)] for p in b.params]
            for i in idx:
                ref_p[i].grad = self.params[i].grad
            TorchBatch([ref_p[i] for i in idx], [ref_bufs[i] for i in idx], b.m, b.n).run(self.hyper)
        self.opt.step()
        torch.cuda.synchronize()
        errors = [relative_error(p, q) for p, q in zip(self.params, ref_p, strict=True)]
        errors += [relative_error(b, q) for b, q in zip(self.bufs, ref_bufs, strict=True)]
        self.restore()
        return max(errors)  # relative_error gives inf, never NaN, for a non-finite result


def muon_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[MuonTuningTask]:
    """One task per tune size's model (its hidden matrices) and parameter dtype (fp32, bf16)."""
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return [MuonTuningTask(dtype_of[d], device, bandwidth_tbs, model=model_at(MUON, numel, hidden=True))
            for numel in MUON.tune_sizes for d in dtypes if d in dtype_of]  # fmt: skip
