"""Does a shape between the tuned keys get a config close to what tuning it would give? For keys no
workload tunes, the config the lookup picks (the nearest tuned bucket of the same variant) against
the winner of a study of that very key, timed alternately in one process.

    python -m benchmarks.held_out [--trials 30] [--seconds 40] [--rounds 3] [--out DIR]

Held out:
- Newton–Schulz on one 4096 x 11008 matrix (Llama-2-7B's MLP weights): side 4096, FLOP bucket
  2^40, between the tuned 4096^2 (2^39) and 8192^2 (2^42); each product (Gram, poly, update).
- AdamW on a 258M-parameter Llama-style list (d = 1024, 15 layers, ffn 2816; bucket 2^28, between
  the 134M list's 2^27 and Qwen2.5-0.5B's 2^29) with fp32 and bf16 params.

A study runs ``--trials`` configs within ``--seconds`` (the default, the family's seeds and the
borrowed config first, as ``nox -s tune`` starts from the nearest cached entry); then the borrowed
config and the study's winner are timed ``--rounds`` times each, alternately, with the tuner's
timer, and the median of each is reported. The target: borrowed within 5% of tuned.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.reporting import write_report
from kernel_factory.generator.timing import alternate_medians

RESULTS = Path(__file__).resolve().parent / "results" / "held_out"
NS_SHAPE = (1, 4096, 11008)
ADAMW_MODEL = dict(dim=1024, layers=15, ffn=2816, vocab=32000, n_heads=16)  # workloads.llama_param_shapes


def _tasks(bandwidth: float, tflops: float):
    """(task, borrowed config) pairs, built one at a time (the AdamW ones hold gigabytes)."""
    from kernel_factory.optimizers.adamw.tune import AdamWTuningTask
    from kernel_factory.optimizers.muon.newton_schulz_launch import PRODUCTS, ns_config
    from kernel_factory.optimizers.muon.newton_schulz_tune import NewtonSchulzTuningTask
    from kernel_factory.optimizers.shared.workloads import llama_param_shapes

    for product in PRODUCTS:
        task = NewtonSchulzTuningTask((NS_SHAPE,), product, "cuda", tflops)
        yield task, dict(ns_config(task.inputs[0][0])[product])
    shapes = [s for _, s in llama_param_shapes(**ADAMW_MODEL)]
    for dtype in (torch.float32, torch.bfloat16):
        task = AdamWTuningTask(shapes, dtype, "cuda", bandwidth_tbs=bandwidth)
        yield task, task.looked_up_config()


def _alternate(task, timer, configs: dict[str, dict], rounds: int) -> dict[str, float]:
    """Median p50 (ms) of each config over ``rounds`` alternating timings."""

    def measure(config: dict) -> float:
        task.configure(config)
        task.restore()
        return timer(task)[1]

    ms = alternate_medians({name: lambda c=config: measure(c) for name, config in configs.items()}, rounds)
    task.restore()
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=40.0, help="per study")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from kernel_factory.generator import detect_arch
    from kernel_factory.generator.timing import copy_bandwidth_tbs, matmul_tflops, restoring_timer
    from kernel_factory.generator.tuner import key_name, tune_task

    arch, timer = detect_arch(), restoring_timer()
    bandwidth, tflops = copy_bandwidth_tbs(4 << 30), matmul_tflops()
    rows = []
    for task, borrowed in _tasks(bandwidth, tflops):
        study = tune_task(task, arch, timer, trials=args.trials, seconds=args.seconds, storage=None,
                          warm_start=borrowed, final_rounds=0)  # fmt: skip
        tuned = study.best or borrowed
        ms = _alternate(task, timer, {"borrowed": borrowed, "tuned": tuned}, args.rounds)
        gap = 100 * (ms["borrowed"] / ms["tuned"] - 1)
        rows.append(f"| {key_name(task)} | {ms['borrowed']:.4f} | {ms['tuned']:.4f} | {gap:+.1f}% | "
                    f"{'yes' if gap <= 5 else 'no'} | {study.trials} |")  # fmt: skip
        print(rows[-1], flush=True)
        getattr(task, "release", lambda: None)()
    head = (f"Held-out keys on {torch.cuda.get_device_name()}, torch {torch.__version__}: the config the lookup "
            f"gives vs a study of the key ({args.trials} trials, {args.seconds:g} s), timed alternately "
            f"{args.rounds} times (median p50). Command: `python -m benchmarks.held_out --trials {args.trials} "
            f"--seconds {args.seconds:g} --rounds {args.rounds}`")  # fmt: skip
    lines = [head, "", "| key | borrowed ms | tuned ms | borrowed slower by | within 5% | trials |",
             "|---|---:|---:|---:|---|---:|", *rows]  # fmt: skip
    write_report(args.out / "held_out.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
