"""The Newton–Schulz tuning workloads: each product of an NS iteration in bf16, on the batches
Muon and users hand over.

Used by ``python -m kernel_factory.optimizers.tune --families newton_schulz``. Each task is one
product (X Xᵀ, c A Aᵀ + b A, a X + B X; the family's ``product`` axis) at one size bucket (FLOPs of
one iteration of the whole batch, ``iteration_flops``): a single 1024^2, 4096^2 and 8192^2 matrix,
and the two NS batches of the 134M Llama-style list's Muon step: its 48 attention matrices (768 x
768) and its 36 MLP matrices (768 x 2048, tall ones transposed). The products are tuned apart
because they want different kernels: at 48 x 768^2 on the H200 the classic kernels ran X Xᵀ in
59 µs against the hopper ones' 74 at best, and the hopper kernels ran the update in 82 µs
against the classic ones' 93. A
trial checks the product against torch's bf16 matmuls on fresh inputs and times one launch.
"""

from __future__ import annotations

import torch

from kernel_factory.generator import NEWTON_SCHULZ, size_bucket
from kernel_factory.generator.timing import matmul_tflops

from .newton_schulz import NS5_COEFFICIENTS
from .newton_schulz_triton import PRODUCTS, iteration_flops, symmetric_product, update_output, update_product

# (batch, m, n), m <= n, per tune size of the family (size_bucket(iteration_flops(...))).
SHAPES = ((1, 1024, 1024), (1, 4096, 4096), (48, 768, 768), (36, 768, 2048), (1, 8192, 8192))
WORKLOADS = {size_bucket(iteration_flops(*shape)): shape for shape in SHAPES}
TOL = 1e-2  # one bf16 product: its output rounded to 8 bits, its fp32 sums in another order


def symmetric_flops(product: str, batch: int, m: int, n: int) -> float:
    """FLOPs of one ``product`` counting only what the symmetric kernels compute: X Xᵀ (m² n),
    A Aᵀ (m³), B X (2 m² n)."""
    return batch * {"gram": m * m * n, "poly": m**3, "update": 2 * m * m * n}[product]


class NewtonSchulzTuningTask:
    """One product of an NS5 iteration on one (batch, m, n) bf16 workload as a tuner task (its
    inputs are never written)."""

    family = NEWTON_SCHULZ
    tol = TOL

    def __init__(self, shape: tuple[int, int, int], product: str, device: str, tflops: float | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.product, self.device = shape, product, device
        self.a, self.b, self.c = NS5_COEFFICIENTS
        self.inputs = self._inputs()
        self.variant = NEWTON_SCHULZ.tuning_key(NEWTON_SCHULZ.variant(dtype="bfloat16", product=product))
        self.dtype = "bfloat16"
        self.numel = size_bucket(iteration_flops(*shape))  # the cache's size key (ns_config)
        self.floor_ms = symmetric_flops(product, *shape) / (tflops * 1e12) * 1e3 if tflops else None
        self.config = None

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, its gram or poly matrix): what the product reads in the first NS5 iteration."""
        x = torch.randn(self.shape, device=self.device, generator=self.gen).bfloat16()
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        gram = torch.bmm(x, x.mT)
        return x, gram if self.product != "update" else torch.baddbmm(gram, gram, gram, beta=self.b, alpha=self.c)

    def _run(self, inputs, config) -> torch.Tensor:
        x, square = inputs
        if self.product == "update":
            return update_product([square], [x], [update_output(x, config)], self.a, config)[0]
        out = torch.empty_like(square)
        if self.product == "gram":
            symmetric_product([x], [out], None, 1.0, 0.0, config)
        else:
            symmetric_product([square], [out], [square], self.c, self.b, config)
        return out

    def configure(self, config) -> None:
        self.config = dict(config)
        self.run()  # compiles here, so compile failures are typed as such
        torch.cuda.synchronize()

    def run(self) -> None:
        self._run(self.inputs, self.config)

    def restore(self) -> None:
        """Nothing to restore: the inputs are never written."""

    def check(self) -> float:
        """Normwise relative error against torch's bf16 matmuls on fresh inputs."""
        inputs = self._inputs()
        out = self._run(inputs, self.config).float()
        ref = self._run(inputs, dict(self.config, impl="torch")).float()
        error = float((out - ref).norm() / ref.norm())
        return error if torch.isfinite(out).all() else float("inf")


def newton_schulz_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[NewtonSchulzTuningTask]:
    """One task per product and tune size (bf16 only: the fp32 variant exists for the interpreter)."""
    del dtypes, bandwidth_tbs  # compute-bound; the floor comes from the measured matmul rate
    tflops = matmul_tflops(device=device)
    return [NewtonSchulzTuningTask(WORKLOADS[size], product, device, tflops)
            for size in NEWTON_SCHULZ.tune_sizes for product in PRODUCTS]  # fmt: skip
