"""The parity matrix: optimizer x parameter dtype x shape set, against torch.optim.

    python -m kernel_factory.optimizers.parity_matrix [--steps 5]

On a CUDA machine it runs the real (multi-tensor) kernels on the GPU; without one it runs the
generated single-tensor kernels under the Triton interpreter (TRITON_INTERPRET=1 is set here
before triton is imported) on the small shapes, fp32 and fp16 (DESIGN.md: the interpreter's
bf16 is wrong). Prints a table; exits 1 if any cell fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KERNEL_FACTORY_BACKEND", "triton")

from .adam import Adam, AdamW, ReferenceAdam, ReferenceAdamW  # noqa: E402
from .parity import parity_check  # noqa: E402
from .workloads import SHAPE_SETS, ShapeModel  # noqa: E402

# Normwise tolerances, from the arithmetic: fp32 ours vs torch differ by rounding only
# (measured <= 1.3e-7 after 20 steps); bf16 / fp16 storage rounds each step to 8 / 11 bits.
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}
HYPER = dict(lr=1e-2, weight_decay=0.1)


def _oracle(name: str, dtype: torch.dtype):
    """The reference each cell is checked against. fp32: torch.optim's foreach/CPU path (our
    formula; torch's fused CUDA kernel rounds 1 - beta2 to fp32, 1.3e-5 off in exp_avg_sq).
    Low precision: the fp32-math reference (torch's foreach rounds between ops on GPU, and its
    fused CPU kernel computes fp16 in half precision)."""
    if dtype != torch.float32:
        return {"AdamW": ReferenceAdamW, "Adam": ReferenceAdam}[name], "reference"
    ref = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[name]
    if ON_GPU:
        return (lambda ps, **kw: ref(ps, foreach=True, **kw)), "torch foreach"
    return ref, "torch"


def cells():
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
    shape_sets = ["small", "single_4096x1024", "llama134m"] if ON_GPU else ["small"]
    device = "cuda" if ON_GPU else "cpu"
    for name, cls in (("AdamW", AdamW), ("Adam", Adam)):
        for dtype in dtypes:
            for shapes in shape_sets:
                yield name, cls, dtype, shapes, device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    where = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton interpreter)"
    print(f"parity matrix on {where}, {args.steps} steps, hyperparameters {HYPER}")
    header = f"{'optimizer':<9} {'dtype':<9} {'shapes':<17} {'oracle':<14} {'worst rel':>10} {'tol':>7}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for name, cls, dtype, shapes, device in cells():
        ref, oracle = _oracle(name, dtype)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no tuned config" is not a failure
            model = lambda shapes=shapes, dtype=dtype, device=device: ShapeModel(  # noqa: E731
                SHAPE_SETS[shapes], dtype=dtype, device=device
            )
            report = parity_check(model, ref, cls, steps=args.steps, tol=TOL[dtype], **HYPER)
        worst = report.worst()
        failures += not report.passed
        result = "pass" if report.passed else f"FAIL ({worst.name} {worst.what})"
        print(f"{name:<9} {str(dtype)[6:]:<9} {shapes:<17} {oracle:<14} {worst.rel:10.2e} "
              f"{TOL[dtype]:7.0e}  {result}  [{time.perf_counter() - t0:.1f}s]")  # fmt: skip
    print(f"{'all cells pass' if not failures else f'{failures} cell(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
