"""Time the AdamW kernel over a grid of legal configs on one shape set (a hand sweep; the
Optuna tuner replaces it for the cache). Prints the fastest configs and % of floor.

    python benchmarks/sweep_adamw_configs.py --shapes llama134m --dtype fp32 [--limit 40]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kernel_factory.generator import ADAMW
from kernel_factory.generator.timing import copy_bandwidth_tbs, time_ms
from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.workloads import SHAPE_SETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama134m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--blocks", default="512,1024,2048,4096")
    ap.add_argument("--chunks", default="4096,8192,16384,32768,65536")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--stages", default="1")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    shapes = SHAPE_SETS[args.shapes]
    params = [torch.randn(s, device="cuda", dtype=dtype) * 0.02 for _, s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdamW(params, lr=1e-3, weight_decay=0.01)
    opt.step()
    (bucket,) = [b for plan in opt._plans.values() for b in plan.buckets]
    numel = sum(p.numel() for p in params)
    floor_ms = numel * (3 * dtype.itemsize + 4 * dtype.itemsize) / (copy_bandwidth_tbs() * 1e12) * 1e3
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    results = []
    for block, chunk, warps, stages in itertools.product(
        ints(args.blocks), ints(args.chunks), ints(args.warps), ints(args.stages)
    ):
        config = dict(BLOCK=block, CHUNK=chunk, num_warps=warps, num_stages=stages)
        if not ADAMW.is_legal(config):
            continue
        bucket.configure(config)
        opt.step()
        _, p50, _ = time_ms(opt.step, rep_ms=100)
        results.append((p50, config))
    results.sort(key=lambda r: r[0])
    print(f"{args.shapes} {args.dtype}: floor {floor_ms:.4f} ms; default {dict(ADAMW.default_config)}")
    for p50, config in results:
        print(f"  {p50:.4f} ms  {100 * floor_ms / p50:5.1f}% of floor  {config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
