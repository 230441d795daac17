"""Architecture names used as cache keys: ``sm90`` for H100/H200, ``sm80`` for A100, ``cpu``."""

from __future__ import annotations

import torch


def detect_arch(device: torch.device | str | None = None) -> str:
    """``sm<major><minor>`` of a CUDA device (default: the current one), ``cpu`` for CPU
    tensors or when no GPU is present. ROCm devices report their ``gfx`` name."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"
