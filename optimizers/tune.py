"""Tune the optimizer kernels on this machine's GPU and record the winners in the cache.

    python -m kernel_factory.optimizers.tune --arch sm90 [--families adamw] [--match TEXT ...] [--trials N]
        [--minutes M] [--fewer-trials-than N] [--resume | --fresh] [--output PATH]

The generic tuner (kernel_factory.generator.tuner) drives Optuna; each family's ``tune.py`` supplies
its workloads (tasks checked against the family's reference, then timed), listed in
``FAMILY_TASKS`` by kernel family name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernel_factory.generator import detect_arch
from kernel_factory.generator.cache import current_device, overlay_cache_path, packaged_cache_path
from kernel_factory.generator.timing import copy_bandwidth_tbs, restoring_timer
from kernel_factory.generator.tuner import key_name, phase_report, report, studied_less, tune

from .adafactor.tune import adafactor_tasks
from .adam_mini.tune import adam_mini_tasks
from .adamw.tune import adamw_tasks
from .muon.newton_schulz_tune import newton_schulz_tasks
from .muon.tune import muon_tasks
from .turbo_adam.tune import turbo_adam_tasks

FAMILY_TASKS = {"adamw": adamw_tasks, "adam_mini": adam_mini_tasks, "newton_schulz": newton_schulz_tasks,
                "muon": muon_tasks, "turbo_adam": turbo_adam_tasks, "adafactor": adafactor_tasks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, help="the architecture to tune, e.g. sm90 (must be this machine's)")
    ap.add_argument("--families", default=",".join(FAMILY_TASKS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--match", action="append", default=[], help="tune only the keys whose name holds this text, "
                    "e.g. side=2048 (names as the report prints them: family, variant, dtype, bucket); repeat it "
                    "for keys that hold any of several")
    ap.add_argument("--trials", type=int, default=40, help="trials per key")
    ap.add_argument("--fewer-trials-than", type=int, default=None, metavar="N",
                    help="tune only the keys whose entry for this GPU (in --output and the packaged cache) "
                         "came from a study of fewer than N trials, or that have none")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for all keys")
    ap.add_argument("--fresh", action="store_true", help="discard saved studies instead of resuming them")
    ap.add_argument("--resume", action="store_true", help="resume saved studies (the default)")
    ap.add_argument("--output", type=Path, default=None, help="cache file to update (default: the user overlay)")
    args = ap.parse_args(argv)
    unknown = set(args.families.split(",")) - set(FAMILY_TASKS)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILY_TASKS)}")
    local = detect_arch()
    if args.arch != local or local == "cpu":
        print(f"tune: cannot tune {args.arch} on this machine (its device is {local}); run it on a "
              f"{args.arch} GPU", file=sys.stderr)  # fmt: skip
        return 2
    bandwidth = copy_bandwidth_tbs(4 << 30)
    tasks = [t for f in args.families.split(",") for t in FAMILY_TASKS[f](args.dtypes.split(","), "cuda", bandwidth)]
    if args.match:
        tasks = [t for t in tasks if any(text in key_name(t) for text in args.match)]
    if args.fewer_trials_than is not None:
        files = [packaged_cache_path(args.arch), args.output or overlay_cache_path(args.arch)]
        tasks = studied_less(tasks, files, args.arch, current_device(), args.fewer_trials_than)
    if not tasks:
        ap.error(f"no key of {args.families} matches any of {args.match}"
                 + (f" with fewer than {args.fewer_trials_than} trials" if args.fewer_trials_than is not None else ""))
    results = tune(tasks, args.arch, restoring_timer(), local_arch=local, trials=args.trials,
                   minutes=args.minutes, output=args.output, resume=not args.fresh)  # fmt: skip
    print(f"copy bandwidth {bandwidth:.3f} TB/s")
    print(report(results))
    print("\nwhere each key's seconds went")
    print(phase_report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
