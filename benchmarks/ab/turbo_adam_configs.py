"""TurboAdam's fused launch on the 134M list (default mode: 4-bit m, factored v) at the config this
tree selects (its tuned entry, else the family default) and at candidate configs, fp32 and bf16
params, with our AdamW's step on the same tensors beside it: CUDA-graph replays, L2 flushed.

    python -m benchmarks.ab.turbo_adam_configs LABEL ['[{"ROWS": 64, "maxnreg": 96}, ...]']

A candidate is the family default with the given keys changed (illegal ones are skipped). Run it
once per source tree under test (installed in turn), in one call, and compare rows of one GPU
only. Floor: the tuner task's, the bytes the step moves (p read and written, g read twice where
the statistics launch reads it, the state read and written) over the copy bandwidth measured in
the same process. Prints one Markdown row per config.
"""

import json
import sys

import torch

from kernel_factory.generator import TURBO_ADAM
from kernel_factory.generator.timing import copy_bandwidth_tbs, graph_time_ms
from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.turbo_adam.tune import TurboAdamTuningTask

KEYS = ("ROWS", "G", "SPAN", "num_warps", "maxnreg", "PREFETCH")


def main() -> None:
    label = sys.argv[1]
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    bw = copy_bandwidth_tbs()
    print(f"{label}: {torch.cuda.get_device_name()}, copy {bw:.3f} TB/s")
    for dtype in (torch.float32, torch.bfloat16):
        task = TurboAdamTuningTask(dtype, "default", "cuda", bw)
        task.ensure()  # params, optimizer and launch (the tuner builds them at a task's first use)
        floor = task.floor_ms
        configs = [("selected", dict(task.launch.config))]
        for change in overrides:
            config = {**TURBO_ADAM.default_config, **change}
            try:
                TURBO_ADAM.check_config(config)
            except ValueError as e:
                print(f"skipped {change}: {e}")
                continue
            configs.append(("", config))
        task.precompile([c for _, c in configs[1:]])
        name = str(dtype).removeprefix("torch.")
        for tag, config in configs:
            task.configure(config)
            ms = graph_time_ms(task.run, 25, 300)[1]
            shown = {k: config[k] for k in KEYS if k in config}
            print(f"| {label} | {name} | {shown} {tag} | {ms:.4f} ms | floor {floor:.4f} | {100 * floor / ms:.1f}% |")
        adamw = AdamW(task.params, lr=1e-3, weight_decay=0.01)
        adamw.step()
        print(f"| {label} | {name} | our AdamW | {graph_time_ms(adamw.step, 25, 300)[1]:.4f} ms | | |")
        del task, adamw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
