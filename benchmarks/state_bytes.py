"""Optimizer state per parameter on the 134M Llama-style list, counted from the state layouts
TurboAdam would create (on the meta device: nothing is allocated), and from the states Adafactor
creates (on the CPU: it makes them with the optimizer).

    python benchmarks/state_bytes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from kernel_factory.optimizers import Adafactor, TurboAdam  # noqa: E402
from kernel_factory.optimizers.shared.workloads import SHAPE_SETS  # noqa: E402
from kernel_factory.optimizers.turbo_adam.reference import init_state  # noqa: E402

CONFIGS = {"default": {}, "v_bits=4": dict(v_bits=4), "v_bits=8": dict(v_bits=8), "v-only": dict(compress_m=False),
           "m-only": dict(compress_v=False), "both codecs off (AdamW)": dict(compress_m=False, compress_v=False)}


def bytes_per_param(shapes: list[tuple[str, tuple[int, ...]]], options: dict) -> float:
    """State bytes (``step`` left out) over parameters of TurboAdam with ``options`` on ``shapes``."""
    probe = TurboAdam([torch.nn.Parameter(torch.zeros(1))], **options)
    group = probe.param_groups[0]
    total = params = 0
    for _, shape in shapes:
        p = torch.empty(shape, device="meta")
        layout = probe.layout(p, group)
        if layout.exact:  # AdamW's fp32 exp_avg and exp_avg_sq
            total += 8 * p.numel()
        else:
            total += sum(t.numel() * t.element_size() for k, t in init_state(p, layout).items() if k != "step")
        params += p.numel()
    return total / params


def adafactor_bytes_per_param(shapes: list[tuple[str, tuple[int, ...]]], state_bits: int, **options) -> float:
    """State bytes (``step`` left out) over parameters of Adafactor with ``state_bits`` (and
    ``options``: ``beta1``, ``momentum_dtype``) on ``shapes``."""
    params = [torch.nn.Parameter(torch.empty(shape)) for _, shape in shapes]
    opt = Adafactor(params, state_bits=state_bits, **options)
    total = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    return total / sum(p.numel() for p in params)


def main() -> None:
    shapes = SHAPE_SETS["llama134m"]
    count = sum(torch.Size(s).numel() for _, s in shapes) / 1e6
    print(f"TurboAdam state on the 134M list ({count:.1f}M parameters, {len(shapes)} tensors), bytes per parameter")
    for name, options in CONFIGS.items():
        print(f"{name:28s} {bytes_per_param(shapes, options):.4f}")
    print("Adafactor state on the same list, bytes per parameter")
    for bits in (8, 32):
        print(f"{f'state_bits={bits}':28s} {adafactor_bytes_per_param(shapes, bits):.4f}")
    for dtype in ("bf16", "int8"):
        name = f"beta1, momentum_dtype={dtype}"
        print(f"{name:28s} {adafactor_bytes_per_param(shapes, 8, beta1=0.9, momentum_dtype=dtype):.4f}")


if __name__ == "__main__":
    main()
