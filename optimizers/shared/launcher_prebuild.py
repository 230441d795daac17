"""Build Triton's C launcher of a kernel variant beside the variant's compile instead of after it.

Triton 3.6 (torch 2.11's) and earlier, on NVIDIA, launch each kernel through a small C extension
module built with the host's C compiler when the compiled kernel is first loaded
(``triton.backends.nvidia.driver.CudaLauncher``): after its compile, on the same thread. Its
source depends on the kernel's signature alone (argument types; constexprs only as placeholders)
and it is cached on disk by that source. On an empty cache each build took 0.31-0.49 s on an
H200's host, after compiles of 0.4-3.2 s: AdamMini's first step ended 0.42 s after its last
compile (``docs/cold_start.md``).

``build(kernel, args, kwargs, device)`` writes the launcher that ``kernel[grid](*args, **kwargs)``
will load into Triton's cache, from the signature Triton's own binder gives those arguments, so a
compile queued beside it (``precompile.warm``) finds it built. It returns False and does nothing
where Triton has no such launcher (3.7 on builds none), for kernels taking tensor descriptors
(their launcher depends on the compile's metadata), and on any other layout of Triton's
internals than the one it was written against: the launch then builds the launcher as before.

``binder_caches(kernel)``: the kernel's per-device caches, created under one lock: Triton creates
them on first use without one (``JITFunction.device_caches``, a ``defaultdict``), and two
threads compiling variants of one kernel at once could each create them, one thread's compiled
variant then stored in the dict the other replaced (and compiled again at the launch).
"""

from __future__ import annotations

import hashlib
import os
import threading

_lock = threading.Lock()
_built: dict[str, threading.Event] = {}  # launcher source hash -> set once its build has ended


def binder_caches(kernel):
    """``kernel.device_caches[d]`` for the current device ``d`` (Triton's index), created once;
    None where Triton keeps no such caches."""
    from triton.runtime.driver import driver

    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    device = driver.active.get_current_device()
    with _lock:
        return caches[device]


def launcher_source(kernel, args: tuple, kwargs: dict) -> str | None:
    """The C source of the launcher Triton 3.6 builds for this launch (run under the launch's
    device), or None where there is none to build ahead (see the module docstring)."""
    try:
        from triton import knobs
        from triton.backends.nvidia import driver as nvidia
        from triton.runtime.jit import MockTensor
    except ImportError:
        return None
    make_launcher = getattr(nvidia, "make_launcher", None)
    if make_launcher is None or getattr(nvidia, "compile_module_from_src", None) is None:
        return None
    caches = binder_caches(kernel)
    if caches is None or len(caches) != 5:
        return None
    _, _, _, backend, binder = caches
    # run()'s own additions to the launch's keyword arguments (triton/runtime/jit.py)
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)  # fmt: skip
    # warmup()'s own wrapping: a torch dtype stands for a tensor of that dtype
    bound, specialization, options = binder(*map(MockTensor.wrap_dtype, args), **kwargs)
    _, signature, _, _ = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if any(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values()):
        return None
    return make_launcher({}, signature, None)  # (its constants argument is unused)


def build(kernel, args: tuple, kwargs: dict, device) -> bool:
    """Build (into Triton's on-disk cache) the launcher ``kernel[grid](*args, **kwargs)`` loads on
    ``device`` (a torch CUDA device), once per source in a process: True if this call built it
    (or loaded it from a warm cache); False if there is none to build or another call built it,
    in which case this one returns once that build has ended. Tensors in ``args`` only lend their
    dtype and alignment."""
    import torch

    try:
        with torch.cuda.device(device):
            source = launcher_source(kernel, args, kwargs)
    except Exception:  # noqa: BLE001 - another Triton's internals: the launch builds it as before
        return False
    if source is None:
        return False
    digest = hashlib.sha256(source.encode()).hexdigest()
    with _lock:
        done = _built.get(digest)
        if done is None:
            _built[digest] = done = threading.Event()
            mine = True
        else:
            mine = False
    if not mine:
        done.wait()
        return False
    from triton.backends.nvidia import driver as nvidia

    try:  # CudaLauncher's own call: the same source and flags, so the same cache entry
        nvidia.compile_module_from_src(src=source, name="__triton_launcher", library_dirs=nvidia.library_dirs(),
                                       include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)  # fmt: skip
    except Exception:  # noqa: BLE001 - the launch builds it again and reports its error
        with _lock:
            del _built[digest]
        return False
    finally:
        done.set()
    return True


def _after_fork_in_child() -> None:
    """A forked child gets a free lock (a parent's thread may have held it at the fork) and forgets
    the builds the parent's threads had under way."""
    global _lock
    _lock = threading.Lock()
    for digest in [d for d, done in _built.items() if not done.is_set()]:
        del _built[digest]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
