"""kernel_factory.generator: kernel families as data, rendering, arch detection, tuned-config
selection and timing helpers. It knows nothing about optimizers."""

from .arch import detect_arch
from .backend import backend_mode, interpreter_enabled, triton_available
from .cache import select, size_bucket
from .families import (
    ADAFACTOR,
    ADAM_MINI,
    ADAMW,
    FAMILIES,
    MUON,
    MUON_OWNER,
    MUON_ROWS,
    NEWTON_SCHULZ,
    NEWTON_SCHULZ_STREAM_K,
    TURBO_ADAM,
    get_family,
)
from .family import Config, KernelFamily, Tunable
from .render import load, render, template_hash, user_cache_dir

__all__ = [
    "ADAFACTOR",
    "ADAM_MINI",
    "ADAMW",
    "FAMILIES",
    "MUON",
    "MUON_OWNER",
    "MUON_ROWS",
    "NEWTON_SCHULZ",
    "NEWTON_SCHULZ_STREAM_K",
    "TURBO_ADAM",
    "Config",
    "KernelFamily",
    "Tunable",
    "backend_mode",
    "detect_arch",
    "get_family",
    "interpreter_enabled",
    "load",
    "render",
    "select",
    "size_bucket",
    "template_hash",
    "triton_available",
    "user_cache_dir",
]
