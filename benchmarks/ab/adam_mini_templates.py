"""AdamMini's step on a model's list (MODEL, default the 134M list) at a cache file's tuned configs
for that model's bucket, on the template in place: run
once per template version (copied in turn into ``kernel_templates/adam_mini.py.j2``), each in a new
process, alternating, and compare rows of one GPU only. Tuned entries are keyed to the template's
hash, so a changed template would otherwise run the family default.

    LABEL=main NTASKS=2 [MODEL=llama2_7b_4layers] python -m benchmarks.ab.adam_mini_templates autotune_cache/sm90.json

Per task (fp32 params + FP8 momentum, bf16 + FP8, fp32 + fp32; the first NTASKS): the tuner's task
(``adam_mini/tune.py``: a whole step as users call it) configured with the file's entry for the
model's bucket on this GPU, checked against the reference (max relative error), then timed by the tuner's timer
(L2 flushed before each call), the median of three. Prints one Markdown row per task:
label, params, momentum, config, ms, % of floor, error.
"""

import json
import os
import sys

import torch

from benchmarks.ab.measure import checked_median_ms
from kernel_factory.generator.timing import copy_bandwidth_tbs, restoring_timer
from kernel_factory.optimizers.adam_mini.tune import AdamMiniTuningTask

TASKS = ((torch.float32, "fp8"), (torch.bfloat16, "fp8"), (torch.float32, "fp32"))


def main() -> None:
    label = os.environ.get("LABEL", "")
    gpu = torch.cuda.get_device_name()
    model = os.environ.get("MODEL", "llama134m")
    with open(sys.argv[1], encoding="utf-8") as f:
        entries = [e for e in json.load(f)["entries"] if e["family"] == "adam_mini" and e["device"] == gpu]
    bandwidth, timer = copy_bandwidth_tbs(), restoring_timer()
    for dtype, momentum in TASKS[: int(os.environ.get("NTASKS", len(TASKS)))]:
        task = AdamMiniTuningTask(model, dtype, momentum, "cuda", bandwidth)
        config = next((e["config"] for e in entries if (e["variant"], e["dtype"], e["bucket"]) ==
                       (task.variant, task.dtype, task.numel)), None)  # fmt: skip
        if config is None:
            print(f"| {label} | {task.dtype} | {momentum} | no entry |")
            continue
        error, ms = checked_median_ms(task, config, timer)
        print(f"| {label} | {task.dtype} | {momentum} | {config} | {ms:.4f} | {100 * task.floor_ms / ms:.1f} | "
              f"{error:.2e} |", flush=True)  # fmt: skip
        task.release()


if __name__ == "__main__":
    main()
