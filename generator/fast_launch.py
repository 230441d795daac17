"""Triton launches without the JIT's per-call dispatch, for kernels an optimizer step launches again
and again with arguments that specialize the same way.

``JITFunction[grid](*args)`` binds its arguments, specializes each (a tensor's dtype and 16-byte
alignment, an int's value class), hashes a cache key and looks the compiled variant up on every
call: 18-24 us of host time a launch on an H200 machine, 15 through ``FastKernel``, against 9.4-9.6
for a torch ``add_`` (``benchmarks/launch_overhead.py``; the compiled variant's launcher alone
7-10). A step of Muon issues dozens of launches, a sharded step of AdamMini ten: where the host
sets the step's time (small models, every rank of a sharded one), that dispatch is part of it
(``docs/launches.md``).

``FastKernel`` keeps, per kernel, the compiled variants its launches found, keyed by what Triton
specializes on or finer: a tensor's dtype and address modulo 16, an int's or bool's value and
type, a float's type only (Triton never specializes a float argument), None, the keyword
arguments, the current device. A launch whose key was seen goes straight to that variant's
launcher on the current stream; any other launch (first of its key, an argument of another type,
such as a tensor descriptor, a callable grid, launch hooks installed, the interpreter) goes through
the JIT as before, which compiles what it must and reports errors as it would. Where a Triton's
launcher takes other arguments than 3.6-3.9's (a TypeError at the first direct launch) or it has
no ``triton.knobs`` (before 3.4), every launch takes the JIT.
"""

from __future__ import annotations

import inspect
import os
from types import ModuleType

import torch

# keys a kernel keeps at most: an argument whose value changes every launch (an int that counts
# steps, say) would otherwise add one a launch; past this, launches of new keys take the JIT
MAX_VARIANTS = 64

# ``KERNEL_FACTORY_FAST_LAUNCH=0`` (read at import) sends every launch through the JIT (A/B timing, debugging)
ENABLED = os.environ.get("KERNEL_FACTORY_FAST_LAUNCH", "1") != "0"


class _Uncacheable(Exception):
    """An argument whose specialization ``_key`` does not know: the launch takes the JIT."""


def _key(args: tuple) -> tuple:
    """What Triton's compiled variant may depend on in each of ``args``, or finer (a loop, not a
    function call per argument: this is most of a fast launch's own time)."""
    out = []
    for a in args:
        kind = type(a)
        if kind is float:
            out.append(float)
        elif kind is int:
            out.append(a)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() & 15))
        elif kind is bool:
            out.append((bool, a))
        elif a is None:
            out.append(None)
        else:
            raise _Uncacheable
    return tuple(out)


def _cuda_stream() -> tuple[int, int]:
    """(current device index, its current stream's raw handle), as Triton's driver finds them
    (``torch.cuda.current_device()`` less its Python wrapper)."""
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


class FastKernel:
    """``kernel[grid](*args, **kwargs)`` with ``kernel``'s meaning (a Triton ``JITFunction``): the
    same variant, arguments, stream and errors, the JIT's dispatch skipped where a launch's key was
    seen before (module docstring). Every other attribute is ``kernel``'s. ``stream()`` gives
    (device index, raw stream handle) for a launch (tests stand one in)."""

    def __init__(self, kernel, stream=_cuda_stream) -> None:
        self.kernel = kernel
        self._stream = stream
        # key -> (compiled variant, its launcher, function and metadata, values of the params after the positional ones)
        self._variants: dict[tuple, tuple] = {}
        # (len(args), keyword names) -> names of the params after the positional ones
        self._tail: dict[tuple, tuple] = {}

    def __getattr__(self, name: str):
        if name == "kernel":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch ``kernel[grid](*args, **kwargs)``; returns the compiled variant (as the JIT does)."""
        if not (ENABLED and type(grid) is tuple) or _hooks():
            return self.kernel[grid](*args, **kwargs)
        device, stream = self._stream()
        try:
            key = (device, _key(args), tuple(kwargs.items()))
            found = self._variants.get(key)
        except (_Uncacheable, TypeError):  # TypeError: an unhashable keyword value
            return self.kernel[grid](*args, **kwargs)
        if found is None:
            return self._first(key, grid, args, kwargs)
        compiled, run, function, metadata, tail = found
        x = grid[0]
        y = grid[1] if len(grid) > 1 else 1
        z = grid[2] if len(grid) > 2 else 1
        try:
            run(x, y, z, stream, function, metadata, None, None, None, *args, *tail)
        except TypeError:  # a launcher that takes its arguments otherwise (a Triton other than 3.6-3.9)
            _give_up()
            return self.kernel[grid](*args, **kwargs)
        return compiled

    def _first(self, key: tuple, grid: tuple, args: tuple, kwargs: dict):
        """A launch through the JIT, its variant kept for ``key`` where the launcher can take it."""
        compiled = self.kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # a compile handed back as a future
            compiled = compiled.result()
        tail = self._tail_values(len(args), kwargs)
        usable = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
        if tail is not None and usable and len(self._variants) < MAX_VARIANTS:
            self._variants[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
        return compiled

    def _tail_values(self, n_args: int, kwargs: dict) -> tuple | None:
        """The values the launcher takes after the ``n_args`` positional arguments: each later
        parameter's keyword argument or default (constexprs included, as the JIT passes them), or
        None where one has neither (the JIT call above has raised for it then)."""
        names = self._tail.get((n_args, tuple(kwargs)))
        if names is None:
            params = getattr(self.kernel, "params", None)
            if params is None:
                return None
            names = self._tail[(n_args, tuple(kwargs))] = tuple(p.name for p in params[n_args:])
        defaults = {p.name: p.default for p in self.kernel.params}
        values = []
        for name in names:
            if name in kwargs:
                values.append(kwargs[name])
            elif defaults[name] is not inspect.Parameter.empty:
                values.append(defaults[name])
            else:
                return None
        return tuple(values)


def _hooks() -> bool:
    """Whether a launch hook is installed (a profiler's): such launches take the JIT, which calls it.
    A hook is a callable or None (Triton 3.6), or a chain of them, empty when none is (later ones).
    A Triton without ``triton.knobs`` (before 3.4) keeps its hooks elsewhere: its launches all take
    the JIT."""
    if not _RUNTIME:
        import triton

        _RUNTIME.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    runtime = _RUNTIME[0]
    if runtime is None:
        return True
    enter = getattr(runtime, "launch_enter_hook", None)
    leave = getattr(runtime, "launch_exit_hook", None)
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True)))


_RUNTIME: list = []  # triton.knobs.runtime (None where there is none), found at the first launch


def _give_up() -> None:
    """Every launch from now on through the JIT, with one warning: a compiled variant's launcher
    refused the arguments the JIT passes it (its Triton calls it otherwise)."""
    global ENABLED
    if ENABLED:
        ENABLED = False
        import warnings

        warnings.warn("kernel_factory: Triton's launcher takes its arguments otherwise than expected; every "
                      "launch goes through the JIT (as with KERNEL_FACTORY_FAST_LAUNCH=0)", stacklevel=3)  # fmt: skip


class FastModule:
    """A generated kernel module whose ``JITFunction`` attributes are ``FastKernel`` s (one each,
    made at first access); its other attributes are the module's."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self._kernels: dict[str, FastKernel] = {}

    def __getattr__(self, name: str):
        if name in ("module", "_kernels"):  # not set yet: no recursion
            raise AttributeError(name)
        kernel = self._kernels.get(name)
        if kernel is not None:
            return kernel
        value = getattr(self.module, name)
        if _is_jit(value):
            kernel = self._kernels[name] = FastKernel(value)
            return kernel
        return value


def _is_jit(value) -> bool:
    """A compiled-on-GPU Triton kernel (not the interpreter's stand-in)."""
    from triton.runtime.jit import JITFunction

    return isinstance(value, JITFunction)
