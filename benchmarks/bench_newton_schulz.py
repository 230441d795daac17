"""Newton–Schulz and Muon timings, part of ``nox -s bench`` (``--ns-sizes``; empty skips it).

- NS5 on one bf16 m x n matrix: ours (``fast_newton_schulz``, the tuned choice of kernels or
  matmuls) against torch's bf16 matmuls (torch.optim.Muon's iteration), and the floor: the FLOPs
  the symmetric products need at the bf16 matmul rate measured in the same run, 5 (3 s² L + s³)
  for short side s and long side L (X Xᵀ and A A symmetric, B X whole; 20 n³ for n x n).
  ``--ns-sizes`` takes ``n`` (square), ``mxn``, and ``@model``: the distinct hidden-matrix shapes
  of a model of ``workloads.MODELS`` with both sides >= 2048. Ours and torch's are timed in turn,
  5 rounds, the median of each (``timing.alternate_medians``). Beside them, the rate torch's bf16
  matmul reaches on the Gram's own shape (s x L times L x s, a whole product) as a share of the
  8192^3 rate the floor uses: how much of the floor's rate one product of that size gets at all.
- A Muon step over the 84 hidden matrices of the 134M Llama-style list (fp32 params and grads):
  ours against torch.optim.Muon with the same hyperparameters, and the host time to issue it.

Writes benchmarks/results/bench_newton_schulz.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kernel_factory.generator.timing import alternate_medians, matmul_tflops, time_ms
from kernel_factory.optimizers import Muon, fast_newton_schulz
from kernel_factory.optimizers.muon.newton_schulz import reference_newton_schulz
from kernel_factory.optimizers.shared import precompile
from kernel_factory.optimizers.shared.workloads import MODELS, SHAPE_SETS, hidden_matrices

MODEL_NS_MIN_SIDE = 2048  # the NS target covers matrices with both sides at least this long


def parse_ns_sizes(spec: str) -> list[tuple[int, int]]:
    """The matrices of ``--ns-sizes``: comma-separated ``n`` (n x n), ``mxn`` and ``@model`` (the
    distinct hidden-matrix shapes of ``workloads.MODELS[model]`` with both sides >= 2048, in the
    model's order); duplicates dropped. Bad tokens raise ValueError naming them."""
    out: list[tuple[int, int]] = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        if token.startswith("@"):
            if token[1:] not in MODELS:
                raise ValueError(f"--ns-sizes: unknown model {token[1:]!r}; known: {', '.join(MODELS)}")
            shapes = [s for _, s in hidden_matrices(SHAPE_SETS[token[1:]]) if min(s) >= MODEL_NS_MIN_SIDE]
        else:
            sides = token.lower().split("x")
            if len(sides) not in (1, 2) or not all(side.isdigit() and int(side) > 0 for side in sides):
                raise ValueError(f"--ns-sizes: {token!r} is not n, mxn or @model")
            shapes = [(int(sides[0]), int(sides[-1]))]
        for shape in shapes:
            if shape not in out:
                out.append(shape)
    return out


def ns_floor_flops(m: int, n: int) -> int:
    """FLOPs of five NS iterations' symmetric products on an m x n matrix: with s and L its short and
    long sides, X Xᵀ (s² L, symmetric), A A (s³, symmetric) and B X (2 s² L)."""
    short, long = min(m, n), max(m, n)
    return 5 * (3 * short * short * long + short**3)


def gram_rate_share(m: int, n: int, tflops: float) -> float:
    """torch's bf16 matmul rate on an m x n matrix's Gram (short side s, long side L: s x L times
    L x s, 2 s^2 L FLOPs) as a share of ``tflops``, the 8192^3 rate."""
    short, long = min(m, n), max(m, n)
    a = torch.randn(short, long, device="cuda", dtype=torch.bfloat16)
    b = a.t()
    ms = time_ms(lambda: a @ b, rep_ms=100)[1]
    return 2 * short * short * long / (ms * 1e-3) / 1e12 / tflops


def ns_rows(shapes: list[tuple[int, int]], tflops: float) -> list[str]:
    rows = []
    for m, n in shapes:
        share = gram_rate_share(m, n, tflops)
        g = torch.randn(m, n, device="cuda")
        # alternately, 5 rounds: one timing each of 2048 x 8192 and 8192 x 2048 (the same kernels)
        # differed by up to 1.5x between runs
        fns = {"ours": lambda: fast_newton_schulz(g), "peer": lambda: reference_newton_schulz(g)}  # noqa: B023
        ms = alternate_medians({name: lambda fn=fn: time_ms(fn, rep_ms=100)[1] for name, fn in fns.items()}, rounds=5)
        ours, peer = ms["ours"], ms["peer"]
        floor = ns_floor_flops(m, n) / (tflops * 1e12) * 1e3
        rows.append(f"| NS5 {m}x{n} bf16 | {ours:.3f} | {peer:.3f} | {floor:.3f} | {100 * floor / ours:.1f} | "
                    f"{peer / ours:.2f}x | {100 * share:.1f} |")  # fmt: skip
    return rows


def host_ms(fn, reps: int = 20, hold_cycles: int = 0) -> float:
    """Milliseconds of host time to issue ``fn()``: the GPU is synchronized before and after the
    ``reps`` calls, not between them, so the host does not wait on it; ``hold_cycles``: a sleep
    kernel of that many clock cycles queued first, the GPU busy while the calls are issued."""
    torch.cuda.synchronize()
    if hold_cycles:
        torch.cuda._sleep(hold_cycles)
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
        precompile.settle()  # ours: the two-part NS kernels, which the first steps do not wait for
        opt.step()
        times[name] = time_ms(opt.step)[1]
        hosts[name] = host_ms(opt.step)
    return [f"| Muon step, {len(shapes)} hidden matrices of llama134m (fp32) | {times['ours']:.3f} | "
            f"{times['torch']:.3f} | n/a | n/a | {times['torch'] / times['ours']:.2f}x | n/a |", "",
            f"Host time to issue one Muon step (no GPU sync between steps): ours {hosts['ours']:.3f} ms, "
            f"torch.optim.Muon {hosts['torch']:.3f} ms."]  # fmt: skip


def run(sizes: list[tuple[int, int]], out: Path, command: str) -> None:
    """Time NS5 on the ``sizes`` matrices (m, n) and the 134M Muon step; write
    ``out/bench_newton_schulz.md``."""
    if os.environ.get("KERNEL_FACTORY_BACKEND", "auto") == "torch":
        raise RuntimeError("bench_newton_schulz compares our kernels with torch: unset KERNEL_FACTORY_BACKEND=torch")
    tflops = matmul_tflops()
    lines = [f"Newton-Schulz on {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul "
             f"{tflops:.0f} TFLOP/s (8192^3) measured in the same run. Command: `{command}`", "",
             "| workload | ours ms | torch ms | floor ms | % of floor | ours faster | torch Gram rate, % of 8192^3 |",
             "|---|---|---|---|---|---|---|",
             *ns_rows(sizes, tflops), *muon_rows()]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_newton_schulz.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
