"""How long an optimizer's first ``step()`` takes in a new process: with empty kernel caches (a new
machine or container, as cluster jobs get) and again with the on-disk caches that first run left.

    python -m benchmarks.cold_start [--optimizers a,b] [--shapes llama134m] [--dtype fp32] [--out DIR]

Each optimizer runs in fresh Python processes of its own, whose Triton cache (``TRITON_CACHE_DIR``)
and kernel_factory cache (``KERNEL_FACTORY_CACHE_DIR``: rendered kernels, the tuning overlay) start
empty in a new temporary folder: ``cold`` is the first process's first step, ``warm`` that of a
second process given the same folders. Two more processes wait ``--gap`` seconds between
construction and ``step()``, standing for the first forward and backward, which the kernels'
background compiles overlap (``kernel_factory/optimizers/shared/precompile.py``): one on those warm
folders, one on new empty ones. Times are wall-clock seconds on the host, from the call to
``step()`` until the GPU has finished it (imports, parameter creation and the optimizer's
construction are reported apart). The steady step is the median of five steps after the first two
(Muon's second may capture its Newton–Schulz CUDA graph again, once the two-part kernels compiling
in the background are ready: ``kernel_factory/optimizers/muon/plan.py``). ``first_step_compiles.md``
lists the longest background compiles of each process on empty caches and when they ran (and the
C launchers built beside them, "launcher of" a variant, where Triton builds them). Python's
bytecode is cached for all of them, as in an installed environment (``PYTHONPYCACHEPREFIX``, filled
by one unreported process per optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.reporting import write_report

DEFAULT = ",".join(f"kernel_factory_{name}" for name in ("adamw", "adam_mini", "muon", "turbo_adam", "adafactor"))
RESULTS = Path(__file__).resolve().parent / "results" / "cold_start"


def _child(name: str, shapes: str, dtype: str, gap: float) -> None:
    """Build ``name`` on ``shapes``, wait ``gap`` seconds, time its construction, its first step and
    the median of steps 3 to 7; print JSON, with the background compiles' (variant, start, end) in
    seconds from the call to the first step."""
    import torch

    from benchmarks.bench import DTYPES, LR, SHAPES_OF, WD, named_params
    from benchmarks.registry import REGISTRY
    from kernel_factory.optimizers.shared import precompile
    from kernel_factory.optimizers.shared.workloads import SHAPE_SETS

    named = named_params(SHAPE_SETS[shapes], DTYPES[dtype])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt = REGISTRY[name].build(named, SHAPES_OF[shapes], LR, WD)
    torch.cuda.synchronize()
    time.sleep(gap)
    t1 = time.perf_counter()
    steps = []
    for _ in range(7):
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
    compiles = [(label, start - t1, end - t1) for label, start, end in precompile.timeline()]
    print(json.dumps({"build_s": t1 - t0 - gap, "first_step_s": steps[0], "steady_step_s": statistics.median(steps[2:]),
                      "compiles": compiles}))


def _run(name: str, shapes: str, dtype: str, caches: Path, gap: float = 0.0) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "KERNEL_FACTORY_CACHE_DIR": str(caches / "kf")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--child", name, "--shapes", shapes,
                          "--dtype", dtype, "--gap", str(gap)], env=env, capture_output=True, text=True,
                         check=False)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: the child failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def first_step_cold(name: str, shapes: str, dtype: str) -> float:
    """Seconds of ``name``'s first step in a new process with empty caches, called at once."""
    with tempfile.TemporaryDirectory(prefix="kf_cold_") as tmp:
        return _run(name, shapes, dtype, Path(tmp))["first_step_s"]


def measure(name: str, shapes: str, dtype: str, gap: float) -> dict:
    """Cold and warm first steps of ``name`` (two fresh processes sharing new, empty cache folders),
    one more on the warm folders and one on new empty folders, each ``gap`` seconds after construction;
    a process before them, not reported, fills the bytecode folder (``main``)."""
    first_step_cold(name, shapes, dtype)
    with tempfile.TemporaryDirectory(prefix="kf_cold_") as tmp:
        cold = _run(name, shapes, dtype, Path(tmp))
        warm = _run(name, shapes, dtype, Path(tmp))
        warm_later = _run(name, shapes, dtype, Path(tmp), gap)
    with tempfile.TemporaryDirectory(prefix="kf_cold_") as tmp:
        later = _run(name, shapes, dtype, Path(tmp), gap)
    return {"optimizer": name, "build_cold_s": cold["build_s"], "first_step_cold_s": cold["first_step_s"],
            "first_step_cold_later_s": later["first_step_s"], "build_warm_s": warm["build_s"],
            "first_step_warm_s": warm["first_step_s"], "first_step_warm_later_s": warm_later["first_step_s"],
            "steady_step_s": warm["steady_step_s"], "compiles_cold": cold["compiles"]}  # fmt: skip


def write_table(args, rows: list[dict], device: str, torch_version: str) -> None:
    """``cold_start.md`` under ``args.out``: the command, then one line of ``measure``'s figures per
    optimizer measured so far."""
    head = (f"First step in a new process on {device}, {args.shapes}, {args.dtype} params, "
            f"torch {torch_version}; seconds (construction apart), Python bytecode cached. Command: "
            f"`python -m benchmarks.cold_start --optimizers {args.optimizers} --shapes {args.shapes} "
            f"--dtype {args.dtype} --gap {args.gap:g}`")  # fmt: skip
    if len(rows) < len(args.optimizers.split(",")):
        head += f" (cut short after {len(rows)} of them)"
    later = f"first step {args.gap:g} s after build"
    lines = [head, "", f"| optimizer | build, empty caches | first step, empty caches | {later}, empty caches | "
             f"build, warm caches | first step, warm caches | {later}, warm caches | steady step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        cells = [f"{r[k]:.3f}" for k in ("build_cold_s", "first_step_cold_s", "first_step_cold_later_s",
                                         "build_warm_s", "first_step_warm_s", "first_step_warm_later_s")]  # fmt: skip
        lines.append(f"| {r['optimizer']} | {' | '.join(cells)} | {r['steady_step_s']:.4f} |")
    write_report(args.out / "cold_start.md", lines)
    write_compiles(args, rows)


def write_compiles(args, rows: list[dict], top: int = 6) -> None:
    """``first_step_compiles.md`` under ``args.out``: per optimizer, the longest background compiles
    of its process on empty caches (step called at once), with when each started and ended, in
    seconds from the call to the first step (negative: during construction)."""
    lines = [f"The longest background compiles of each optimizer's process on empty caches, its first step "
             f"called at once (`cold_start.md`'s second column); seconds from the call to `step()`. Command: "
             f"`python -m benchmarks.cold_start --optimizers {args.optimizers} --shapes {args.shapes} "
             f"--dtype {args.dtype}`", "", "| optimizer | variant | start | end | seconds | first step ended |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        longest = sorted(r["compiles_cold"], key=lambda c: c[2] - c[1], reverse=True)[:top]
        for label, start, end in longest:
            lines.append(f"| {r['optimizer']} | `{label}` | {start:.2f} | {end:.2f} | {end - start:.2f} | "
                         f"{r['first_step_cold_s']:.2f} |")
    write_report(args.out / "first_step_compiles.md", lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default=DEFAULT)
    ap.add_argument("--shapes", default="llama134m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between construction and step() (third run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.shapes, args.dtype, args.gap)
        return 0
    import torch

    # Python's bytecode: an installed package has it (pip compiles .pyc files at install time), a
    # read-only environment without it compiles torch's and Triton's modules from source in every
    # process (1-2 s, holding the GIL that the background compiles need). The children share one
    # bytecode folder, filled by a process of each optimizer before its measured ones.
    os.environ.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="kf_pyc_"))
    rows = []
    for name in args.optimizers.split(","):
        rows.append(measure(name, args.shapes, args.dtype, args.gap))
        print(json.dumps(rows[-1]), flush=True)
        write_table(args, rows, torch.cuda.get_device_name(), torch.__version__)  # a run cut short keeps its rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
