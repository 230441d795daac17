"""The Newton–Schulz tuning workloads: each product of an NS iteration in bf16, on the batches
Muon and users hand over.

Used by ``python -m kernel_factory.optimizers.tune --families newton_schulz``. Each task is one
product (X Xᵀ, c A Aᵀ + b A + a I, Bm X; the family's ``product`` axis) at one key: the short side
and the size bucket (FLOPs of one iteration, ``iteration_flops``) of the batch with the most work.
The workloads: a single 1024^2, 2048^2, 2048 x 8192, 4096^2 and 8192^2 matrix, the 134M
Llama-style list's 36 MLP matrices (768 x 2048, tall ones transposed) with its 48 attention ones
(768 x 768) in the same launches, as Muon's step runs them, and the batches of an owner rank's two
NS stages in sharded Muon at 2 ranks (WORKLOADS). The products are tuned apart because they want
different kernels. A trial checks the product against torch's bf16 matmuls on fresh inputs and
times the replay of a CUDA graph of one launch (of each batch, for torch's matmuls).
"""

from __future__ import annotations

import torch

from kernel_factory.generator import NEWTON_SCHULZ, size_bucket
from kernel_factory.generator.timing import matmul_tflops

from .newton_schulz import NS5_COEFFICIENTS
from .newton_schulz_launch import (
    PRODUCTS,
    iteration_flops,
    side_class,
    symmetric_product,
    update_output,
    update_product,
)

# The batches (batch, m, n), m <= n, of each tuned key of the family: the short side and
# size_bucket(iteration_flops) of the first, the one with the most work, which is the batch whose
# config a joint launch takes (joint_newton_schulz, ns_config). The 36 x 768 x 2048 key is run as
# Muon's step runs it, with the 48 x 768^2 batch in the same launches: alone, cuBLAS ran that
# batch's update in 139 µs against the hopper kernel's 148 on the H200, which says nothing of the
# joint launch the key is used for (allows).
#
# An owner's NS in sharded Muon at 2 ranks (distributed.py: each rank owns half of every batch's
# matrices; NS runs in two stages of about equal work) on the 123M GQA model of
# benchmarks/bench_dist.py (q and o 768^2, k and v 192 x 768, gate and up 2048 x 768, down
# 768 x 2048; 12 layers): the first stage's three batches key as 48 x 768^2 did (2^37; no one-GPU
# model's joint launch takes that key, a joint launch keys by its largest batch), the second's
# six 768 x 2048 matrices a side-1024 key of their own (2^36), which took the 2^37 entry before.
WORKLOADS = (((1, 1024, 1024),), ((12, 768, 2048), (12, 768, 768), (12, 192, 768)),
             ((36, 768, 2048), (48, 768, 768)), ((1, 2048, 2048),), ((1, 2048, 8192),), ((1, 4096, 4096),),
             ((1, 8192, 8192),), ((6, 768, 2048),))  # fmt: skip


def workload_key(shapes: tuple[tuple[int, int, int], ...]) -> tuple[int, int]:
    """(side, size bucket) of a workload: the cache key its tasks tune (ns_config's)."""
    return side_class(shapes[0][1]), size_bucket(iteration_flops(*shapes[0]))
TOL = 1e-2  # one bf16 product: its output rounded to 8 bits, its fp32 sums in another order


def symmetric_flops(product: str, batch: int, m: int, n: int) -> float:
    """FLOPs of one ``product`` counting only what the symmetric kernels compute: X Xᵀ (m² n),
    A Aᵀ (m³), Bm X (2 m² n)."""
    return batch * {"gram": m * m * n, "poly": m**3, "update": 2 * m * m * n}[product]


class NewtonSchulzTuningTask:
    """One product of an NS5 iteration on one or more (batch, m, n) bf16 batches, run together as
    joint_newton_schulz runs them, as a tuner task (its inputs are never written)."""

    family = NEWTON_SCHULZ
    tol = TOL
    # Timed as a CUDA graph replay (restoring_timer): Muon's step replays its NS iterations from a
    # graph and fast_newton_schulz does so for small batches, while a launch issued from Python
    # costs 30 µs and more of host time, as long as a 48 x 768^2 product on the GPU.
    graph_replayed = True

    def __init__(self, shapes: tuple[tuple[int, int, int], ...], product: str, device: str,
                 tflops: float | None = None, seed: int = 0) -> None:  # fmt: skip
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.shapes, self.product, self.device = shapes, product, device
        self.a, self.b, self.c = NS5_COEFFICIENTS
        self.inputs = self._inputs()
        side, self.numel = workload_key(shapes)  # the cache's keys (ns_config)
        self.variant = NEWTON_SCHULZ.tuning_key(NEWTON_SCHULZ.variant(dtype="bfloat16", product=product, side=side))
        self.dtype = "bfloat16"
        flops = sum(symmetric_flops(product, *shape) for shape in shapes)
        self.floor_ms = flops / (tflops * 1e12) * 1e3 if tflops else None
        self.config = None

    def _inputs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per batch (x, its gram or poly matrix): what the product reads in the first NS5 iteration."""
        inputs = []
        for shape in self.shapes:
            x = torch.randn(shape, device=self.device, generator=self.gen).bfloat16()
            x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
            gram = torch.bmm(x, x.mT)
            if self.product == "update":
                gram = torch.baddbmm(gram, gram, gram, beta=self.b, alpha=self.c)
                gram += self.a * torch.eye(shape[1], dtype=gram.dtype, device=gram.device)
            inputs.append((x, gram))
        return inputs

    def _run(self, inputs, config) -> list[torch.Tensor]:
        xs, squares = (list(t) for t in zip(*inputs, strict=True))
        if self.product == "update":
            return update_product(squares, xs, [update_output(x, config) for x in xs], config)
        outs = [torch.empty_like(square) for square in squares]
        if self.product == "gram":
            symmetric_product(xs, outs, None, 1.0, 0.0, config)
        else:
            symmetric_product(squares, outs, squares, self.c, self.b, config, gamma=self.a)
        return outs

    def allows(self, config) -> bool:
        """Every config of the family, except torch's matmuls for the Gram and update products of
        a joint workload: Muon's step runs their first iteration on X scaled by 1 / norm inside
        the kernels, where torch's matmuls take a normalized copy of X (a pass of its own), and
        on the H200 its step took 3.41 to 3.44 ms with cuBLAS updates against 2.89 to 3.06 with
        the hopper kernel taking both batches, though cuBLAS won the update's study (224 µs).
        Nor the stream-K impl for the update, which has only the symmetric products' kernel."""
        if config["impl"] == "stream_k" and self.product == "update":
            return False  # there is no stream-K update: it would time the hopper kernel under another name
        return len(self.shapes) == 1 or self.product == "poly" or config["impl"] != "torch"

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
        outs = self._run(inputs, self.config)
        refs = self._run(inputs, dict(self.config, impl="torch"))
        if not all(torch.isfinite(out).all() for out in outs):
            return float("inf")
        return max(float((out.float() - ref.float()).norm() / ref.float().norm())
                   for out, ref in zip(outs, refs, strict=True))  # fmt: skip


def newton_schulz_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[NewtonSchulzTuningTask]:
    """One task per product and tune size (bf16 only: the fp32 variant exists for the interpreter)."""
    del dtypes, bandwidth_tbs  # compute-bound; the floor comes from the measured matmul rate
    tflops = matmul_tflops(device=device)
    return [NewtonSchulzTuningTask(shapes, product, device, tflops) for shapes in WORKLOADS for product in PRODUCTS]
