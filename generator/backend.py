"""Which implementation runs: ``KERNEL_FACTORY_BACKEND=auto|triton|torch``.

- ``auto`` (default): Triton kernels on CUDA tensors, torch's own kernels on CPU.
- ``triton``: Triton everywhere; CPU tensors need ``TRITON_INTERPRET=1``.
- ``torch``: the pure PyTorch reference everywhere.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

BACKENDS = ("auto", "triton", "torch")


def backend_mode() -> str:
    """The requested backend; an unknown value raises ValueError naming the allowed ones."""
    mode = os.environ.get("KERNEL_FACTORY_BACKEND", "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"KERNEL_FACTORY_BACKEND={mode!r} is not one of {BACKENDS}")
    return mode


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors with numpy (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
