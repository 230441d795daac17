"""Load Triton's per-kernel launcher modules so that threads loading them at once cannot swap them.

Triton (3.6 and earlier on NVIDIA) builds a small C extension module for each kernel signature, all
named ``__triton_launcher``, and loads each with ``importlib`` (``triton.runtime.build.
_load_module_from_path``). They are single-phase-init modules, and CPython keeps one entry per
name in ``sys.modules``: loading a file a second time in a process (two kernels with the same
signature) does not make a new module but refills the dict of the module that ``sys.modules``
holds under that name, the one loaded last, with the second file's functions. A thread that has
just loaded that last module and not yet read its ``launch`` then reads another kernel's launcher.
Found on an H100 with compiles on our background threads (``precompile``) and a warm on-disk
cache: a Muon step raised ``TypeError: function takes exactly 71 arguments (24 given)``. Reproduced
without a GPU (``tests/test_launcher_loading.py``): a second load of file A changes what the
module returned for file B calls.

``install()`` wraps that loader once per process: loads run one at a time, and each caller gets a
private module holding what its file defined, which no later load can change.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Callable

_lock = threading.RLock()  # (reentrant: a load that loads another cannot deadlock)


def private_loader(load: Callable[[str, str], types.ModuleType]) -> Callable[[str, str], types.ModuleType]:
    """``load(name, path)`` made safe from several threads: one load at a time, and a private copy
    of the loaded module returned (its functions keep the shared module alive)."""

    def load_privately(name: str, path: str) -> types.ModuleType:
        with _lock:
            shared = load(name, path)
            private = types.ModuleType(shared.__name__, shared.__doc__)
            private.__dict__.update(shared.__dict__)
        return private

    load_privately.__wrapped__ = load
    return load_privately


def install() -> None:
    """Wrap Triton's extension-module loader with ``private_loader`` (once per process; nothing
    where Triton has no such loader)."""
    try:
        from triton.runtime import build
    except ImportError:
        return
    load = getattr(build, "_load_module_from_path", None)
    if load is not None and not hasattr(load, "__wrapped__"):
        build._load_module_from_path = private_loader(load)


def _after_fork_in_child() -> None:
    """A forked child gets a free lock (a parent's thread may have held it at the fork)."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
