"""Compile time against step time, per config, for the two kernels a first step waits longest for
(AdamMini's FP8 update, TurboAdam's default-mode update) on the 134M list.

    TRITON_CACHE_DIR=$(mktemp -d) python -m benchmarks.ab.compile_vs_speed am ta

``am``: AdamMini with FP8 momentum, fp32 then bf16 params; ``ta``: TurboAdam's default mode, fp32
then bf16 params. For each task the tuner's task is built at the config this tree selects (its
compile is not timed: it happens at allocation), then each candidate below, the selected config
with the given keys changed, is compiled as a first step compiles it (its kernels on background
threads, in parallel, ``task.precompile``) into a new, empty Triton cache directory and timed
(wall seconds), checked against the reference (the tuner's error measure) and timed by the
tuner's timer (L2 flushed, the median of three p50s). Prints one Markdown row per config:
task, change, compile s, step ms, % of floor, error. Compile seconds are CPU work on the GPU's
host: compare rows of one run only.
"""

import os
import sys
import tempfile
import time

import torch

from benchmarks.ab.measure import checked_median_ms
from kernel_factory.generator import ADAM_MINI, TURBO_ADAM
from kernel_factory.generator.timing import copy_bandwidth_tbs, restoring_timer
from kernel_factory.optimizers.adam_mini.tune import AdamMiniTuningTask
from kernel_factory.optimizers.turbo_adam.tune import TurboAdamTuningTask

ADAM_MINI_CHANGES = (
    dict(ROWS=1, COLS=512, num_warps=1, num_stages=2), dict(ROWS=1, COLS=512, num_warps=2, num_stages=2),
    dict(ROWS=1, COLS=512, num_warps=4, num_stages=2), dict(ROWS=1, COLS=1024, num_warps=4, num_stages=2),
    dict(ROWS=1, COLS=256, num_warps=1, num_stages=2), dict(ROWS=2, COLS=512, num_warps=4, num_stages=2),
    dict(ROWS=1, COLS=512, num_warps=2, num_stages=1), dict(ROWS=2, COLS=256, num_warps=1, num_stages=1),
)  # fmt: skip
TURBO_ADAM_CHANGES = (
    {}, dict(maxnreg=0), dict(maxnreg=96), dict(maxnreg=128), dict(G=4), dict(G=4, num_warps=2), dict(ROWS=8),
    dict(PREFETCH=1),
)  # fmt: skip


def compare(task, family, changes, tag: str, timer) -> None:
    """Print a row per legal change of ``task``'s selected config (see the module's docstring)."""
    task.ensure()
    selected = dict(task.plans[0].config) if hasattr(task, "plans") else dict(task.launch.config)
    print(f"{tag}: selected {selected}", flush=True)
    for change in changes:
        config = {**selected, **change}
        try:
            family.check_config(config)
        except ValueError as e:
            print(f"skipped {change}: {e}")
            continue
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        start = time.perf_counter()
        task.precompile([config])
        seconds = time.perf_counter() - start
        error, ms = checked_median_ms(task, config, timer)
        print(f"| {tag} | {change or 'selected'} | {seconds:.2f} s | {ms:.4f} ms | {100 * task.floor_ms / ms:.1f}% "
              f"| {error:.1e} |", flush=True)  # fmt: skip
    task.release()


def main() -> None:
    which = sys.argv[1:] or ["am", "ta"]
    bandwidth, timer = copy_bandwidth_tbs(), restoring_timer()
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth:.3f} TB/s", flush=True)
    if "am" in which:
        for dtype in (torch.float32, torch.bfloat16):
            task = AdamMiniTuningTask("llama134m", dtype, "fp8", "cuda", bandwidth)
            compare(task, ADAM_MINI, ADAM_MINI_CHANGES, f"adam_mini {task.dtype}/fp8", timer)
    if "ta" in which:
        for dtype in (torch.float32, torch.bfloat16):
            task = TurboAdamTuningTask(dtype, "default", "cuda", bandwidth)
            compare(task, TURBO_ADAM, TURBO_ADAM_CHANGES, f"turbo_adam {task.dtype}", timer)


if __name__ == "__main__":
    main()
