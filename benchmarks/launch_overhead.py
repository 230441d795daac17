"""Host time of one Triton launch: through the JIT (``kernel[grid](...)``), through ``FastKernel``
(generator/fast_launch.py), and a torch ``add_`` for scale. The stream is held by a sleep kernel
while ``--launches`` launches are issued (fewer than the launch queue holds, so none waits for the
GPU); median of ``--rounds`` rounds, microseconds per launch.

    python benchmarks/launch_overhead.py [--launches 400] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.bench_newton_schulz import host_ms  # noqa: E402
from kernel_factory.generator.fast_launch import FastKernel  # noqa: E402


@triton.jit
def scale_shift(src, dst, a2, a3, a4, a5, n, n1, n2, n3, x, x1, x2, x3, x4, BLOCK: tl.constexpr, G: tl.constexpr):
    # an optimizer launch's argument list in size: 6 pointers, 4 ints, 5 floats, 2 constexprs
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) * x + x1, mask=mask)


def per_launch_us(launch, launches: int) -> float:
    """Host microseconds per ``launch()``, issued behind a ~25 ms sleep (longer than they take)."""
    return host_ms(launch, launches, hold_cycles=50_000_000) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    n = 1 << 16
    bufs = [torch.zeros(n, device="cuda") for _ in range(6)]
    call = (*bufs, n, 7, 9, 11, 0.5, 0.25, 1.5, 2.5, 3.5)
    grid = (n // 1024,)
    fast = FastKernel(scale_shift)
    ways = {
        "JIT": lambda: scale_shift[grid](*call, BLOCK=1024, G=2),
        "FastKernel": lambda: fast[grid](*call, BLOCK=1024, G=2),
        "torch add_": lambda: bufs[0].add_(1.0),
    }
    for launch in ways.values():  # compile, and the fast path's first (JIT) launch
        launch()
        launch()
    rows = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, launch in ways.items():
            rows[name].append(per_launch_us(launch, args.launches))
    print(f"{torch.cuda.get_device_name()}, Triton {triton.__version__}, torch {torch.__version__}: host us per launch "
          f"(median of {args.rounds} rounds of {args.launches})\n")  # fmt: skip
    print("| launch | us |\n|---|---:|")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
