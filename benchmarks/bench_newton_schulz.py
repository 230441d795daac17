"""Newton–Schulz and Muon timings, part of ``nox -s bench`` (``--ns-sizes``; empty skips it).

- NS5 on one bf16 n x n matrix: ours (``fast_newton_schulz``, the tuned choice of kernels or
  matmuls) against torch's bf16 matmuls (torch.optim.Muon's iteration), and the floor: the
  20 n^3 FLOPs the symmetric products need at the bf16 matmul rate measured in the same run.
- A Muon step over the 84 hidden matrices of the 134M Llama-style list (fp32 params and grads):
  ours against torch.optim.Muon with the same hyperparameters, and the host time to issue it.

Writes benchmarks/results/bench_newton_schulz.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kernel_factory.generator.timing import matmul_tflops, time_ms
from kernel_factory.optimizers import Muon, fast_newton_schulz
from kernel_factory.optimizers.muon.newton_schulz import reference_newton_schulz
from kernel_factory.optimizers.shared.workloads import SHAPE_SETS


def ns_rows(sizes: list[int], tflops: float) -> list[str]:
    rows = []
    for n in sizes:
        g = torch.randn(n, n, device="cuda")
        ours = time_ms(lambda: fast_newton_schulz(g))[1]  # noqa: B023 (called before the next n)
        peer = time_ms(lambda: reference_newton_schulz(g))[1]  # noqa: B023
        floor = 20 * n**3 / (tflops * 1e12) * 1e3
        rows.append(f"| NS5 {n}x{n} bf16 | {ours:.3f} | {peer:.3f} | {floor:.3f} | {100 * floor / ours:.1f} | "
                    f"{peer / ours:.2f}x |")  # fmt: skip
    return rows


def host_ms(fn, reps: int = 20) -> float:
    """Milliseconds of host time to issue ``fn()``: the GPU is synchronized before and after the
    ``reps`` calls, not between them, so the host does not wait on it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e3


def muon_rows() -> list[str]:
    """The Muon step's row of the table, then a line with the host time to issue one step."""
    shapes = SHAPE_SETS["llama134m_hidden"]
    times, hosts = {}, {}
    for name, build in (("ours", Muon), ("torch", torch.optim.Muon)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.randn(s, device="cuda", generator=gen) * 0.02 for _, s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt = build(params, lr=0.02, weight_decay=0.1)
        opt.step()
        times[name] = time_ms(opt.step)[1]
        hosts[name] = host_ms(opt.step)
    return [f"| Muon step, {len(shapes)} hidden matrices of llama134m (fp32) | {times['ours']:.3f} | "
            f"{times['torch']:.3f} | n/a | n/a | {times['torch'] / times['ours']:.2f}x |", "",
            f"Host time to issue one Muon step (no GPU sync between steps): ours {hosts['ours']:.3f} ms, "
            f"torch.optim.Muon {hosts['torch']:.3f} ms."]  # fmt: skip


def run(sizes: list[int], out: Path, command: str) -> None:
    """Time NS5 at ``sizes`` and the 134M Muon step; write ``out/bench_newton_schulz.md``."""
    if os.environ.get("KERNEL_FACTORY_BACKEND", "auto") == "torch":
        raise RuntimeError("bench_newton_schulz compares our kernels with torch: unset KERNEL_FACTORY_BACKEND=torch")
    tflops = matmul_tflops()
    lines = [f"Newton-Schulz on {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul "
             f"{tflops:.0f} TFLOP/s (8192^3) measured in the same run. Command: `{command}`", "",
             "| workload | ours ms | torch ms | floor ms | % of floor | ours faster |", "|---|---|---|---|---|---|",
             *ns_rows(sizes, tflops), *muon_rows()]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_newton_schulz.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
