"""A/B of the symmetric Newton–Schulz products: one program per upper tile in turn (the hopper
kernel) against the K steps of all tiles split evenly over the SMs (stream-K), same tiles.

    python -m benchmarks.ab.ns_stream_k [--out FILE.md]

Each cell is one product of an NS5 iteration on one bf16 matrix as the tuner times it (a CUDA
graph replay of one launch, L2 flushed before it; the median of three p50s), with its normwise
error against torch's bf16 matmuls, and % of the product's symmetric FLOPs at the bf16 matmul rate
measured in the same run. torch's matmuls (cuBLAS, the whole product) are timed beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kernel_factory.generator.timing import matmul_tflops, restoring_timer
from kernel_factory.optimizers.muon.newton_schulz_tune import NewtonSchulzTuningTask

from .measure import checked_median_ms

TILES = dict(BLOCK=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
# The hopper kernel's tuned tiles at the side-2048 keys (4 warps, 5 stages) and 8 warps, 4 stages.
LAUNCHES = (dict(num_warps=4, num_stages=5), dict(num_warps=8, num_stages=4))
SHAPES = ((1, 2048, 2048), (1, 2048, 8192), (1, 4096, 4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    tflops = matmul_tflops()
    timer = restoring_timer()
    rows = []
    for shape in SHAPES:
        for product in ("gram", "poly"):
            task = NewtonSchulzTuningTask((shape,), product, "cuda", tflops)
            cells = {"torch": dict(TILES, impl="torch", **LAUNCHES[1])}
            for launch in LAUNCHES:
                for impl in ("hopper", "stream_k"):
                    cells[f"{impl} {launch['num_warps']}w{launch['num_stages']}s"] = dict(TILES, impl=impl, **launch)
            for name, config in cells.items():
                error, ms = checked_median_ms(task, config, timer)
                rows.append((f"{shape[1]} x {shape[2]}", product, name, ms * 1e3, 100 * task.floor_ms / ms, error))
                print(*rows[-1], flush=True)
    lines = [f"Symmetric NS products on {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul "
             f"{tflops:.0f} TFLOP/s measured in the same run. Command: `python -m benchmarks.ab.ns_stream_k`", "",
             "| matrix | product | kernel | µs | % of floor | error vs torch |",
             "|---|---|---|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {m} | {p} | {k} | {us:.1f} | {pct:.1f} | {err:.1e} |" for m, p, k, us, pct, err in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
