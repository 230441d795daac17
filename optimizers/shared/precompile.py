"""Compile an optimizer's Triton kernels in background threads from the moment it is built, so a new
process's first ``step()`` waits only for what the first forward and backward did not hide.

A kernel's first launch in a process compiles it (Triton: Python to MLIR to PTX in the process,
ptxas and a C launcher built with the host compiler as subprocesses), or, with a warm on-disk
cache, loads it; before the first of either, Triton hashes its own library once per process
(``triton.runtime.cache.triton_key``, 0.45 s measured with an H100) and builds its driver's C
helpers (0.4 s, then cached on disk). Measured there (``benchmarks/cold_start.py``,
``docs/cold_start.md``): one kernel 0.1-4.3 s to compile, and 8 compiled in 8 threads took a third
of the serial time (the subprocesses and the C++ passes overlap).

``warm(kernel, grid, args, kwargs, device)`` queues the variant's C launcher build
(``launcher_prebuild``: Triton 3.6 builds one per signature when a compiled kernel is loaded) and
``kernel.warmup`` (compile and load, no launch), side by side on up to MAX_THREADS daemon threads,
and returns a ``Warm`` handle; the launch site calls ``handle.wait()`` before its first launch of
that kernel, so the work is never done twice; a variant already queued in the process (by another
plan) is not queued again, its handle shares the first one's compile. A failed warmup is
dropped: the launch then compiles in the caller and raises there, as it would have without this.
Off under the interpreter, on CPU tensors, without Triton, and with ``KERNEL_FACTORY_PRECOMPILE=0``.

``timeline()`` lists the compiles run so far, each with its variant and when it started and ended,
and the launchers built ahead ("launcher of" the variant; ``benchmarks/cold_start.py`` reports
the longest of a first step's).

``later=True`` queues a variant a step may never launch (those taking GradScaler's tensors): it
starts once every other queued compile has finished, so it does not take the host's cores and
the GIL (Triton's Python front end holds it) from the variants the first step waits for; a
``wait()`` on one whose compile has not started takes it off the queue, and the launch compiles
it at once in the caller rather than after the queue.

While any worker runs, the interpreter's switch interval (how long a thread that wants the GIL
waits before the holder is asked to drop it; 5 ms by default) is lowered to FAST_SWITCH_S and put
back by the last worker to finish. Triton's hash reads its 500 MB library in 1 MB chunks, and each
chunk hands the GIL back: with the main thread busy in Python, as it is building the model and the
optimizer, every chunk waited up to 5 ms for it. Measured on a 2-core CPU (triton_key() on a
thread while the main thread imports what torch.optim's first use imports, ``docs/cold_start.md``):
the hash done 2.0-2.3 s after it started at 5 ms, 1.1-1.25 s at 0.5 ms, the imports no slower.

At interpreter exit the queued compiles are dropped and the running ones waited for: a daemon
thread still inside Triton's C++ passes when the interpreter finalizes is ended by
``pthread_exit``, whose forced unwind through those frames aborts the process ("FATAL: exception
not rethrown"; found with a script whose last step left GradScaler's variants compiling).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kernel_factory.generator import backend_mode, interpreter_enabled

# (buckets: its triton_available is the one the kernels' paths consult)
from . import buckets, launcher_loading, launcher_prebuild
from .dtensor import local

MAX_THREADS = min(8, os.cpu_count() or 1)
FAST_SWITCH_S = 0.0005  # the switch interval while workers run (see the module's docstring)
_lock = threading.Lock()
_queue: queue.SimpleQueue = queue.SimpleQueue()
_later: queue.SimpleQueue = queue.SimpleQueue()  # started once _queue is empty and none of it runs
_workers = 0
_saved_switch: float | None = None  # the switch interval the first worker found, put back by the last
_threads: list[threading.Thread] = []  # the workers started (the ended ones pruned at each start)
_running = 0  # items of _queue running now
_started = False  # Triton imported and its driver queued (the first _submit)
_hashing = False  # Triton's hash of itself queued (start_hash or the first _submit)
_timeline: list[tuple[str, float, float]] = []  # (variant, start, end) of each compile run (timeline())
_queued: dict[tuple, tuple] = {}  # (signature, device, later) -> (kernel, future) of each warm() queued


def enabled(device: torch.device) -> bool:
    """Whether kernels for ``device`` are compiled ahead of their first launch."""
    return (device.type == "cuda" and not interpreter_enabled() and buckets.triton_available()
            and os.environ.get("KERNEL_FACTORY_PRECOMPILE", "1") != "0")  # fmt: skip


def worth_planning(params: list[torch.Tensor]) -> bool:
    """Whether an optimizer should build its launch plan for ``params`` (local shards) when it is
    built: some take kernels ahead of time, none would make the plan warn (a non-contiguous param
    takes the reference path with a warning, which belongs to the step) or is refused by the step
    (complex), and the backend is not pinned to PyTorch."""
    return (any(enabled(p.device) for p in params) and all(p.is_contiguous() and not p.is_complex() for p in params)
            and backend_mode() != "torch")  # fmt: skip


def begin(params):
    """Start Triton's once-per-process work (its hash of itself, its driver) in the background if
    any of ``params`` (what an optimizer's constructor takes: tensors, (name, tensor) pairs or param
    groups) is a CUDA tensor whose kernels precompile: called first in a constructor, it overlaps
    the imports torch.optim's ``Optimizer`` does on first use (about 2 s). Returns ``params`` as a
    list (an iterator is consumed here), a bare tensor unchanged (torch.optim's error follows)."""
    if isinstance(params, torch.Tensor):
        return params
    params = list(params)
    for item in params:
        entries = item.get("params", ()) if isinstance(item, dict) else (item,)
        entries = (entries,) if isinstance(entries, torch.Tensor) else entries
        if not isinstance(entries, (list, tuple)):  # an iterator torch.optim has yet to consume
            continue
        for entry in entries:
            tensor = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(tensor, torch.Tensor) and enabled(local(tensor).device):
                _submit(lambda: None)  # queues the once-per-process items first
                return params
    return params


def plan_ahead(optimizer, build: Callable[[int, dict, list], object]) -> None:
    """Build each param group's launch plan when ``optimizer`` is built, for the params that require
    grads, as its first step would build it (and then reuses: the same key), so that its kernels
    compile while the first forward and backward run. ``build(index, group, params)`` caches the
    plan in ``optimizer._plans``; one that cannot be built now is dropped and left to the step,
    which builds it again and reports the error there. A plan already built (``plan_group``, from
    a constructor's ``add_param_group``) is found in that cache."""
    for index, group in enumerate(optimizer.param_groups):
        plan_group(optimizer, build, index, group, group["params"])


def plan_group(optimizer, build: Callable[[int, dict, list], object], index: int, group: dict, params: list) -> None:
    """``plan_ahead``'s work for one group: ``build(index, group, params')`` for the ``params`` that
    require grads, where they take kernels compiled ahead. Called by a constructor's
    ``add_param_group`` before torch.optim's (``group`` then the group as given, torch's defaults
    not yet filled in), so that the first group's kernels compile while torch.optim's first
    ``add_param_group`` imports ``torch._dynamo`` (about 1.5 s; ``docs/cold_start.md``)."""
    if getattr(optimizer, "backend", None) == "torch":
        return
    params = [p for p in params if p.requires_grad and not p.is_meta]
    if not worth_planning([local(p) for p in params]):
        return
    try:
        build(index, group, params)
    except Exception:  # noqa: BLE001 - the step raises it where the user expects it
        optimizer._plans.pop(index, None)


def start_hash() -> None:
    """At import of the optimizers (``kernel_factory/optimizers/__init__.py``): where this process
    can run the kernels, import Triton and start its hash of itself (``triton_key``) on a worker,
    so that it runs while the script builds its model rather than when the optimizer is built,
    where torch.optim's first imports hold the GIL it needs between chunks (measured: 0.45-0.63 s,
    still running at a first step called at once). Only the hash: Triton's driver would initialise
    CUDA, which belongs to the script (a rank picks its GPU after its imports; a fork before CUDA's
    first use must stay possible), so the GPU is found by NVML (``torch.cuda.device_count``)."""
    global _hashing
    if (os.environ.get("KERNEL_FACTORY_PRECOMPILE", "1") == "0" or interpreter_enabled()
            or backend_mode() == "torch" or torch.version.cuda is None or not buckets.triton_available()
            or torch.cuda.device_count() == 0):  # fmt: skip
        return
    with _lock:
        if not _hashing:
            _hashing = True
            _import_triton()
            _queue.put((Future(), _triton_key))
            _spawn_worker()


def _submit(fn: Callable[[], object], later: bool = False) -> Future:
    """Run ``fn`` on one of up to MAX_THREADS daemon threads, which exit when the queue is empty (no
    idle threads are left behind for a later fork, such as a DataLoader's, to copy); ``later``: once
    nothing else is queued or running."""
    global _started, _hashing
    future: Future = Future()
    with _lock:
        spawn = not later
        if not _started:  # Triton's once-per-process work first: its hash of itself, its driver
            _started = spawn = True  # (queued now: a worker must take them, even for a later task)
            _import_triton()
            if not _hashing:
                _hashing = True
                _queue.put((Future(), _triton_key))
            _queue.put((Future(), _triton_driver))
        (_later if later else _queue).put((future, fn))
        if spawn or (_queue.empty() and not _running):
            _spawn_worker()
    return future


def _spawn_worker() -> None:
    """Start a worker if fewer than MAX_THREADS run (called holding _lock)."""
    global _workers, _saved_switch
    if _workers < MAX_THREADS:
        if _workers == 0 and sys.getswitchinterval() > FAST_SWITCH_S:
            _saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(FAST_SWITCH_S)
        _workers += 1
        _threads[:] = [t for t in _threads if t.is_alive()]
        _threads.append(threading.Thread(target=_work, name="kf-compile", daemon=True))
        _threads[-1].start()


def _work() -> None:
    global _workers, _running
    while True:
        with _lock:  # (an item put after this check starts a new worker)
            try:
                future, fn = _queue.get_nowait()
                now = True
            except queue.Empty:
                now = False
                try:
                    if _running:  # the later items wait for these; the last to finish starts them
                        raise queue.Empty
                    future, fn = _later.get_nowait()
                except queue.Empty:
                    _workers -= 1
                    if not _workers:
                        _restore_switch()
                    return
            _running += now
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)
        if now:
            with _lock:
                _running -= 1
                if not _running and _queue.empty():  # this thread goes on to them; more join it
                    for _ in range(min(_later.qsize(), MAX_THREADS) - 1):
                        _spawn_worker()


def _restore_switch() -> None:
    """Put back the switch interval the first worker lowered, unless it was changed since (called
    holding _lock by the last worker to finish)."""
    global _saved_switch
    if _saved_switch is not None and abs(sys.getswitchinterval() - FAST_SWITCH_S) < 1e-6:
        sys.setswitchinterval(_saved_switch)
    _saved_switch = None


@atexit.register
def _drain_at_exit(timeout: float = 120.0) -> None:
    """Cancel every compile not started and join the workers (up to ``timeout`` s in all), so no
    thread of ours is alive when the interpreter finalizes (registered with ``atexit``, which runs
    before daemon threads are stopped). Joined, not counted: a worker that has left its loop still
    runs its thread's teardown (a CUDA context's thread-local state among it)."""
    with _lock:
        for q in (_queue, _later):
            while True:
                try:
                    future, _ = q.get_nowait()
                except queue.Empty:
                    break
                future.cancel()
        threads = list(_threads)
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader's worker, say) has none of the parent's workers: it starts with
    an empty pool (the counts and queues copied from the parent would make it wait for threads that
    do not exist) and the parent's switch interval from before the workers lowered it."""
    global _lock, _queue, _later, _workers, _running, _saved_switch, _threads, _optional, _timeline, _queued
    _lock = threading.Lock()
    _optional, _timeline, _queued = {}, [], {}  # the parent's compiles: none of them runs here
    _queue, _later = queue.SimpleQueue(), queue.SimpleQueue()
    _workers = _running = 0
    _threads = []
    if _saved_switch is not None:
        sys.setswitchinterval(_saved_switch)
        _saved_switch = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _import_triton() -> None:
    """Import, in the calling thread, the Triton modules the workers use: a package imported by a
    worker while the caller imports it too can be seen half-initialised by the caller (found with
    torch._inductor importing triton.backends beside a worker's first import of triton). Also makes
    the launchers' loads safe from several threads (``launcher_loading``), before any worker runs."""
    import triton.compiler  # noqa: F401
    import triton.runtime.driver  # noqa: F401

    launcher_loading.install()

    try:
        import triton.runtime.cache  # noqa: F401
    except ImportError:  # another Triton layout: _triton_key does nothing there
        pass


def _triton_key() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton layout: its first compile computes what it needs
        return
    triton_key()


def _triton_driver() -> None:
    """Triton's CUDA driver object (its first use builds or loads a small C module)."""
    from triton.runtime.driver import driver

    driver.active.get_current_target()


class Warm:
    """A kernel variant compiling in the background (``warm``); ``wait()`` before launching it."""

    def __init__(self, future: Future | None, later: bool = False) -> None:
        self._future, self._later = future, later

    def done(self) -> bool:
        """Whether the compile has ended (or was never queued): a launch now finds it loaded."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Block until the compile finished (or failed: the launch then compiles and reports); a
        ``later`` one not started yet is dropped from the queue, for the launch to compile at once."""
        future, self._future = self._future, None
        if future is not None and not (self._later and future.cancel()):
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the caller's own launch raises the real error
                pass


def warm(kernel, grid: tuple, args: tuple, kwargs: dict, device: torch.device, later: bool = False) -> Warm:
    """Compile and load ``kernel[grid](*args, **kwargs)``'s variant on ``device`` in the background
    (nothing runs on the GPU). ``args`` are the launch's arguments; tensors only lend their dtype and
    alignment, so placeholders of the right dtype serve where the real ones do not exist yet.
    ``later``: a variant a step may never launch, compiled after everything else queued."""
    if not enabled(device):
        return Warm(None)
    # One compile per variant in a process: two plans (param groups, say) that launch the same
    # variant share its compile instead of running two at once (seen on an H100: AdamMini's two
    # plans compiled its 3.7 s row kernel twice, side by side).
    key = (_signature(kernel, args, kwargs), str(device), later)
    queued = _queued.get(key)
    if queued is not None and not queued[1].cancelled():
        return Warm(queued[1], later)
    label = f"{getattr(kernel, '__name__', type(kernel).__name__)} {dict(sorted(kwargs.items()))}"

    def build_launcher() -> None:
        start = time.perf_counter()
        if launcher_prebuild.build(kernel, args, kwargs, device):
            _timeline.append((f"launcher of {label}", start, time.perf_counter()))

    # The launcher first, so that it builds beside the compile (launcher_prebuild's docstring)
    launcher = _submit(build_launcher, later)

    def compile_variant() -> None:
        start = time.perf_counter()
        try:
            with torch.cuda.device(device):  # a new thread starts on device 0
                launcher_prebuild.binder_caches(kernel)  # (created once: the launcher's build reads them too)
                compiled = kernel.warmup(*args, grid=grid, **kwargs)
                # A launcher build under way is waited for (the load would build it again); one
                # not started is dropped and the load builds it. (exception(): waits, raises nothing)
                if not launcher.cancel():
                    launcher.exception()
                init = getattr(compiled, "_init_handles", None)  # load the module (and its launcher)
                if init is not None:
                    init()
        finally:
            _timeline.append((label, start, time.perf_counter()))

    future = _submit(compile_variant, later)
    _queued[key] = (kernel, future)  # (the kernel kept alive: its id is in the key)
    return Warm(future, later)


def timeline() -> list[tuple[str, float, float]]:
    """(variant, start, end) of each background compile this process has run (ended ones; a failed
    one too) and of each launcher built ahead (labelled "launcher of <variant>"), in the order they
    ended; ``time.perf_counter()`` seconds. The variant: the kernel's name and the launch's keyword
    arguments (constexprs and launch options). What a first step waited for, for
    ``benchmarks/cold_start.py``."""
    return list(_timeline)


def _signature(kernel, args: tuple, kwargs: dict) -> tuple:
    """What a launch's compiled variant depends on, coarsely (Triton specializes tensors on dtype
    and 16-byte alignment, ints on 1, multiples of 16 and int32 range, descriptors on dtype and
    block): launches with the same signature share one compile (``warm``)."""

    def kind(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, bool) or a is None or isinstance(a, (str, torch.dtype)):
            return ("value", a)
        if isinstance(a, int):
            return ("int", a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
        if isinstance(a, float):
            return ("float",)
        base = getattr(a, "base", None)  # a TensorDescriptor
        return (type(a).__name__, tuple(getattr(a, "block_shape", ())), getattr(base, "dtype", None))

    return (id(kernel), tuple(map(kind, args)), tuple(sorted(kwargs.items())))


def warm_launches(launches: list[tuple], device: torch.device, later: bool = False) -> list[Warm]:
    """``warm`` each of ``launches`` ((kernel, grid, args, kwargs) as the step will issue them,
    placeholders allowed as in ``warm``) on ``device``; launches of one variant share its compile."""
    return [warm(kernel, grid, args, kwargs, device, later) for kernel, grid, args, kwargs in launches]


# Variants a step may launch in place of others once compiled (``warm_optional``), by signature.
_optional: dict[tuple, Warm] = {}


def warm_optional(launches: list[tuple], device: torch.device) -> list[Warm]:
    """``warm_launches(launches, device, later=True)`` for variants that stand in for others once
    compiled: a step launches one only when ``ready`` says so and never waits for it (Muon's
    two-part Newton–Schulz kernels, whose one-part variants give the same bits and compile in half
    the time)."""
    warms = warm_launches(launches, device, later=True)
    for (kernel, _, args, kwargs), w in zip(launches, warms, strict=True):
        _optional[_signature(kernel, args, kwargs)] = w
    return warms


def ready(kernel, args: tuple, kwargs: dict) -> bool:
    """False while a ``warm_optional`` variant with this launch's signature still compiles (or waits
    to): launching it now would compile it in the caller. True otherwise."""
    if not _optional:  # the common case once they have compiled: no signature to form
        return True
    key = _signature(kernel, args, kwargs)
    w = _optional.get(key)
    if w is not None and w.done():
        del _optional[key]
    return w is None or w.done()


def optional_pending() -> bool:
    """Whether any ``warm_optional`` variant still compiles or waits to."""
    for key in [k for k, w in _optional.items() if w.done()]:
        del _optional[key]
    return bool(_optional)


def warm_config(plan, config, launches: Callable[[], list[tuple]]) -> list[Warm]:
    """``warm_launches`` of ``plan``'s launches under ``config`` (``launches()`` lists them once
    ``plan.configure(config)`` has run), leaving ``plan`` on the config it had: its attributes are
    put back as they were (``configure`` rebinds them to new objects; it mutates none in place).
    The tuner's compile-ahead: a batch of trials' kernels compile in parallel before any is timed.
    A config ``configure`` refuses queues nothing (its trial reports the error); nor does a plan
    whose kernels are not compiled ahead (``enabled``)."""
    if not enabled(plan.device):
        return []
    saved = dict(vars(plan))
    try:
        plan.configure(config)
        pending = launches()
    except Exception:  # noqa: BLE001 - the trial's own configure raises it where it is recorded
        return []
    finally:
        vars(plan).clear()
        vars(plan).update(saved)
    return warm_launches(pending, plan.device)


def settle(timeout: float = 600.0) -> bool:
    """Block until no background compile is queued or running, the ``later`` ones included (up to
    ``timeout`` s; False if some still ran then). For a benchmark before it times: a compile holds
    the GIL for part of its time (and the workers shorten the switch interval), so launches timed
    beside one wait on the host. Seen on an H200: TurboAdam's 134M step timed while its GradScaler
    variants compiled, 1.39 ms replayed from a graph against 0.77 once they had finished."""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            alive = [t for t in _threads if t.is_alive()]
        if not alive:
            return True
        for thread in alive:
            thread.join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            with _lock:
                return not any(t.is_alive() for t in _threads)


def wait_all(warms: list[Warm]) -> None:
    """``wait()`` for each of ``warms`` (and empty the list: they are waited for once)."""
    while warms:
        warms.pop().wait()
