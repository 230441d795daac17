"""Compile time and code size of a generated kernel for sm_90 without a GPU: Triton compiles for a
target it is given (its bundled ptxas), so a template change's cost to a first step on an empty
Triton cache can be compared on a CPU machine before any GPU time is spent.

    python -m benchmarks.ab.compile_offline KERNEL [--param-dtype float32] [--repeat 2]
        [--constexprs '{"ROWS": 16}'] [--warps 1] [--stages 1] [--maxnreg 64] [--sass]

KERNEL: ``adam_mini`` (FP8 momentum's update kernel; default constexprs: the whole-row launch of
the 134M list's 768-wide rows, 512 + 256 columns, one warp), ``turbo_adam`` (the default mode's
update kernel at the tuned 134M config) or ``turbo_adam_stats`` (its statistics kernel). Each
compile runs in this process after a tiny kernel's (Triton's once-per-process work apart), into
a new, empty Triton cache. Prints one line per compile: wall seconds, the backend's stages
(TTIR, TTGIR, LLVM IR, PTX, cubin) and the PTX size; with ``--sass``, the SASS instruction count
and the memory instructions among it. The signature types pointers by the argument's name (the
templates' tables of addresses as int64), so compare rows of one machine and one signature only:
the figures are CPU time, longer or shorter than a GPU host's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile
import time

from kernel_factory.generator import ADAM_MINI, TURBO_ADAM, load

DEFAULTS = {
    "adam_mini": (dict(ROWS=1, COLS=256, SUB=128, VEC=16, W0=512, W1=256, W2=0), dict(num_warps=1, num_stages=2)),
    "turbo_adam": (dict(ROWS=16, G=2, MB=128, ALIGNED=True, INT64=False, FULL=True, PREFETCH=0),
                   dict(num_warps=1, num_stages=1, maxnreg=64)),
    "turbo_adam_stats": (dict(RT=16, TC=256, NBT=8, ALIGNED=True, INT64=False), dict(num_warps=4, num_stages=1)),
}  # fmt: skip
INT32_POINTERS = {"items_ptr", "work_ptr", "done_ptr", "launch_ptr", "band_done", "stripe_done"}
INT64_POINTERS = {"meta_ptr", "tel_count", "tel_clip"}


def kernel_function(name: str, param_dtype: str):
    """The JIT function of ``name`` (see the module docstring) rendered for ``param_dtype``."""
    if name == "adam_mini":
        module = load(ADAM_MINI, ADAM_MINI.variant(multi_tensor=True, param_dtype=param_dtype, momentum="float8e4nv"))
        return module.module.adam_mini_kernel
    module = load(TURBO_ADAM, TURBO_ADAM.variant(multi_tensor=True, param_dtype=param_dtype, m_codec="q4",
                                                 v_codec="factored", exact_items=True, split_rows=False,
                                                 grad_scaling=False))  # fmt: skip
    return module.module.turbo_adam_stats_kernel if name == "turbo_adam_stats" else module.module.turbo_adam_kernel


def signature(fn, constexprs: dict) -> dict[str, str]:
    """Triton signature of ``fn``: constexprs as given, pointers typed by name, other args fp32.
    AdamMini's meta table is int32 (its docstring); TurboAdam's int64."""
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg.endswith("_table"):
            sig[arg] = "*i64"
        elif arg in INT32_POINTERS or (arg == "meta_ptr" and "items_ptr" in fn.arg_names):
            sig[arg] = "*i32"
        elif arg in INT64_POINTERS:
            sig[arg] = "*i64"
        elif arg.endswith("_ptr") or arg.startswith("tel_"):
            sig[arg] = "*fp32"
        else:
            sig[arg] = "fp32"
    return sig


def sass_counts(cubin: bytes) -> tuple[int, dict[str, int]]:
    """(instructions, counts of the memory and barrier opcodes) of a cubin's SASS (cuobjdump)."""
    from triton.tools.disasm import get_sass

    ops = collections.Counter(re.findall(r"^\S+\t(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", get_sass(cubin), re.M))
    return sum(ops.values()), {k: ops[k] for k in ("LDG", "STG", "LDS", "STS", "LDGSTS", "LDL", "STL", "BAR")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=sorted(DEFAULTS))
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--constexprs", default="{}", help="JSON: constexprs changed from the kernel's defaults")
    ap.add_argument("--warps", type=int)
    ap.add_argument("--stages", type=int)
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sass", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's default (no warning)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    constexprs, options = DEFAULTS[args.kernel]
    constexprs = {**constexprs, **json.loads(args.constexprs)}
    options = dict(options)
    for key, value in (("num_warps", args.warps), ("num_stages", args.stages), ("maxnreg", args.maxnreg)):
        if value is not None:
            options[key] = value
    options = {k: v for k, v in options.items() if v}  # maxnreg 0: no cap
    stage_seconds: dict[str, float] = collections.defaultdict(float)
    add_stages = CUDABackend.add_stages

    def timed_stages(self, stages, opts, *rest):
        add_stages(self, stages, opts, *rest)
        for key, stage in list(stages.items()):

            def run(*a, _stage=stage, _key=key):
                start = time.perf_counter()
                try:
                    return _stage(*a)
                finally:
                    stage_seconds[_key] += time.perf_counter() - start

            stages[key] = run

    CUDABackend.add_stages = timed_stages
    target = GPUTarget("cuda", 90, 32)

    @triton.jit
    def _tiny(x_ptr):
        tl.store(x_ptr, 1.0)

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    triton.compile(ASTSource(fn=_tiny, signature={"x_ptr": "*fp32"}, constexprs={}), target=target)
    fn = kernel_function(args.kernel, args.param_dtype)
    src = ASTSource(fn=fn, signature=signature(fn, constexprs),
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    print(f"{args.kernel} {args.param_dtype} {constexprs} {options}")
    for _ in range(args.repeat):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        stage_seconds.clear()
        start = time.perf_counter()
        compiled = triton.compile(src, target=target, options=options)
        seconds = time.perf_counter() - start
        stages = ", ".join(f"{k} {v:.2f}" for k, v in stage_seconds.items())
        line = f"compile {seconds:.2f} s ({stages}), PTX {len(compiled.asm['ptx']) // 1024} KB"
        if args.sass:
            total, memory = sass_counts(compiled.asm["cubin"])
            line += f", SASS {total} instructions {memory}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
