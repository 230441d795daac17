"""The Newton–Schulz tuning workloads: NS5 in bf16 on the batches Muon and users hand over.

Used by ``python -m kernel_factory.optimizers.tune --families newton_schulz``. Each task is one
size bucket (FLOPs of one iteration of the whole batch, ``iteration_flops``): a single 1024^2,
4096^2 and 8192^2 matrix, and the two NS batches of the 134M Llama-style list's Muon step: its
48 attention matrices (768 x 768) and its 36 MLP matrices (768 x 2048, tall ones transposed).
A trial checks the config against torch's bf16 matmuls on a fresh input and times the five
iterations.
"""

from __future__ import annotations

import torch

from kernel_factory.generator import NEWTON_SCHULZ, size_bucket
from kernel_factory.generator.timing import matmul_tflops

from .newton_schulz import NS5_COEFFICIENTS, coefficient_schedule, iterate
from .newton_schulz_triton import iteration_flops

# (batch, m, n), m <= n, per tune size of the family (size_bucket(iteration_flops(...))).
SHAPES = ((1, 1024, 1024), (1, 4096, 4096), (48, 768, 768), (36, 768, 2048), (1, 8192, 8192))
WORKLOADS = {size_bucket(iteration_flops(*shape)): shape for shape in SHAPES}
TOL = 2e-2  # bf16 products: 8-bit rounding of every intermediate (tests/test_muon_cpu.py)


def symmetric_flops(batch: int, m: int, n: int, steps: int) -> float:
    """FLOPs of ``steps`` iterations counting only what the symmetric kernels compute:
    X Xᵀ (m² n), A Aᵀ (m³) and B X (2 m² n) per iteration."""
    return steps * batch * (3 * m * m * n + m**3)


class NewtonSchulzTuningTask:
    """NS5 on one (batch, m, n) bf16 workload as a tuner task (nothing is updated in place)."""

    family = NEWTON_SCHULZ
    tol = TOL

    def __init__(self, shape: tuple[int, int, int], device: str, tflops: float | None = None, seed: int = 0):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.device = shape, device
        self.x = self._input()
        self.schedule = coefficient_schedule(NS5_COEFFICIENTS, 5)
        self.variant = NEWTON_SCHULZ.tuning_key(NEWTON_SCHULZ.variant(dtype="bfloat16"))
        self.dtype = "bfloat16"
        self.numel = size_bucket(iteration_flops(*shape))  # the cache's size key (ns_config)
        self.floor_ms = symmetric_flops(*shape, 5) / (tflops * 1e12) * 1e3 if tflops else None
        self.config = None

    def _input(self) -> torch.Tensor:
        x = torch.randn(self.shape, device=self.device, generator=self.gen).bfloat16()
        return x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)

    def configure(self, config) -> None:
        self.config = dict(config)
        self.run()  # compiles here, so compile failures are typed as such
        torch.cuda.synchronize()

    def run(self) -> None:
        iterate(self.x, self.schedule, self.config)

    def restore(self) -> None:
        """Nothing to restore: the input is never written."""

    def check(self) -> float:
        """Normwise relative error against torch's bf16 matmuls on a fresh input."""
        x = self._input()
        out = iterate(x, self.schedule, self.config).float()
        ref = iterate(x, self.schedule, dict(self.config, impl="torch")).float()
        error = float((out - ref).norm() / ref.norm())
        return error if torch.isfinite(out).all() else float("inf")


def newton_schulz_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[NewtonSchulzTuningTask]:
    """One task per tune size (bf16 only: the fp32 variant exists for the interpreter)."""
    del dtypes, bandwidth_tbs  # compute-bound; the floor comes from the measured matmul rate
    tflops = matmul_tflops(device=device)
    return [NewtonSchulzTuningTask(WORKLOADS[size], device, tflops) for size in NEWTON_SCHULZ.tune_sizes]
