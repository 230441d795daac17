"""AdamMini's FP8 step with more rows per whole-row program: the plan's cap of elements a thread
holds per stream (``adam_mini.plan.EXACT_PER_THREAD``, 32) raised, on a model's list, bf16 params.

    python -m benchmarks.ab.adam_mini_rows_per_program [MODEL ...]   # default: llama134m

Per (cap, ROWS x warps) below: the tuner's task (``adam_mini/tune.py``) configured, checked against
the reference (the tuner's error measure) and timed by the tuner's timer (L2 flushed, the median
of three p50s); then each launch's device time in one step (torch.profiler, the median of five
steps) with its row shape, items and elements. Prints Markdown rows. A study of the plan's rule:
run it on one GPU and compare rows of one run only.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.ab.measure import checked_median_ms
from kernel_factory.generator import ADAM_MINI
from kernel_factory.generator.timing import copy_bandwidth_tbs, restoring_timer
from kernel_factory.optimizers.adam_mini import plan as adam_mini_plan
from kernel_factory.optimizers.adam_mini.tune import AdamMiniTuningTask

CANDIDATES = ((32, 2, 1), (64, 2, 1), (96, 4, 1), (128, 4, 1), (64, 4, 2), (128, 8, 2), (64, 2, 4))  # cap, ROWS, warps
STEPS = 5


def launch_times_us(task) -> list[float]:
    """Device time of each AdamMini launch of one step, in step order, the median over STEPS steps."""
    task.restore()
    for _ in range(3):
        task.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            task.run()
        torch.cuda.synchronize()
    times = [e.device_time if hasattr(e, "device_time") else e.cuda_time for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "adam_mini" in e.name]  # fmt: skip
    per_step = len(times) // STEPS
    return [sorted(times[i::per_step])[STEPS // 2] for i in range(per_step)]


def main() -> None:
    models = sys.argv[1:] or ["llama134m"]
    bandwidth, timer = copy_bandwidth_tbs(), restoring_timer()
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth:.3f} TB/s\n")
    print("| model | cap | ROWS x warps | step ms | % of floor | error | launches: row shape, items, elements, us |")
    print("|---|---:|---|---:|---:|---:|---|")
    cap_before = adam_mini_plan.EXACT_PER_THREAD
    try:
        study(models, bandwidth, timer)
    finally:
        adam_mini_plan.EXACT_PER_THREAD = cap_before


def study(models, bandwidth: float, timer) -> None:
    """The rows of ``main``: each model's task at each candidate cap and config."""
    for model in models:
        task = AdamMiniTuningTask(model, torch.bfloat16, "fp8", "cuda", bandwidth)
        task.ensure()
        for cap, rows, warps in CANDIDATES:
            adam_mini_plan.EXACT_PER_THREAD = cap
            config = ADAM_MINI.check_config(dict(ROWS=rows, COLS=256, num_warps=warps, num_stages=1))
            task.precompile([config])
            error, ms = checked_median_ms(task, config, timer)
            times = iter(launch_times_us(task))
            launches = []
            for plan in task.plans:
                launches.append(f"begin {next(times):.1f}")
                for (_, _, nrows, widths), items in plan._launches:
                    cols = torch.tensor([plan.meta_rows[int(t)][0] for t in items[:, 0].cpu()])
                    elements = int((items[:, 2].cpu() * cols).sum())
                    launches.append(f"{nrows} x {widths}, {items.shape[0]}, {elements / 1e6:.2f}M, {next(times):.1f}")
            print(f"| {model} | {cap} | {rows} x {warps} | {ms:.4f} | {100 * task.floor_ms / ms:.1f} | {error:.1e} "
                  f"| {'; '.join(launches)} |", flush=True)  # fmt: skip
        task.release()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
