"""Where a new process's first ``step()`` spends its wait on empty caches: each kernel compile
(``triton.compile``) and each C module built with the host's compiler (Triton 3.6's per-signature
launchers, its driver's helpers), with its thread and its start and end in seconds from the call
to ``step()``. ``benchmarks/cold_start.py`` reports the background compiles as wholes; this splits
a compile from the launcher build that Triton 3.6 does when the compiled kernel is loaded.

    python -m benchmarks.ab.first_step_breakdown [kernel_factory_adam_mini] [--shapes llama134m] [--dtype fp32]
        [--launchers-at-load]

``--launchers-at-load``: no launcher built ahead (``optimizers/shared/launcher_prebuild.py``
switched off), Triton's own order: each launcher built when its compiled kernel is loaded.

Runs in this process, on new empty Triton and kernel_factory caches (a temporary folder), so run
it as its own command. A C module that is already built (a launcher built ahead, found in the
cache) shows as a load of about 0 s. Prints one line per compile or build, ordered by start.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("optimizer", nargs="?", default="kernel_factory_adam_mini")
    ap.add_argument("--shapes", default="llama134m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--launchers-at-load", action="store_true")
    args = ap.parse_args()
    caches = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")  # before Triton reads it
    os.environ["KERNEL_FACTORY_CACHE_DIR"] = os.path.join(caches, "kf")
    import triton.compiler

    events: list[tuple[str, str, float, float, str]] = []  # (what, name, start, end, thread)

    def timed(what: str, fn, name_of):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append((what, name_of(a, k), start, time.perf_counter(), threading.current_thread().name))

        return run

    # JIT functions bind triton.compiler.compile on first use (create_binder): patched before any
    triton.compiler.compile = timed("compile", triton.compiler.compile, lambda a, k: a[0].fn.__name__)
    try:
        from triton.backends.nvidia import driver as nvidia

        if hasattr(nvidia, "compile_module_from_src"):  # Triton 3.6 and earlier
            nvidia.compile_module_from_src = timed("C module", nvidia.compile_module_from_src,
                                                   lambda a, k: k.get("name", "?"))  # fmt: skip
    except ImportError:
        pass
    import torch

    if args.launchers_at_load:
        from kernel_factory.optimizers.shared import launcher_prebuild

        launcher_prebuild.build = lambda *_: False
    from benchmarks.bench import DTYPES, LR, SHAPES_OF, WD, named_params
    from benchmarks.registry import REGISTRY
    from kernel_factory.optimizers.shared.workloads import SHAPE_SETS

    named = named_params(SHAPE_SETS[args.shapes], DTYPES[args.dtype])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt = REGISTRY[args.optimizer].build(named, SHAPES_OF[args.shapes], LR, WD)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    order = ", launchers at load" if args.launchers_at_load else ""
    print(f"{args.optimizer} on {torch.cuda.get_device_name()}, {args.shapes}, {args.dtype}: build {t1 - t0:.2f} s, "
          f"first step {t2 - t1:.2f} s (empty caches{order})")  # fmt: skip
    for what, name, start, end, thread in sorted(events, key=lambda e: e[2]):
        print(f"  {what:9s} {name:28s} {start - t1:6.2f} -> {end - t1:6.2f} ({end - start:5.2f} s) {thread}")


if __name__ == "__main__":
    main()
