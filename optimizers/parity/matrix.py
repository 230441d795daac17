"""The parity matrix: optimizer x parameter dtype x shape set, against torch.optim.

    python -m kernel_factory.optimizers.parity.matrix [--steps 5]

On a CUDA machine it runs the real (multi-tensor) kernels on the GPU; without one it runs the
generated single-tensor kernels under the Triton interpreter (TRITON_INTERPRET=1 is set here
before triton is imported) on the small shapes, fp32 and fp16 (DESIGN.md: the interpreter's
bf16 is wrong). Prints a table; exits 1 if any cell fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import warnings

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KERNEL_FACTORY_BACKEND", "triton")

from ..adafactor import Adafactor, ReferenceAdafactor  # noqa: E402
from ..adam_mini import AdamMini, ReferenceAdamMini  # noqa: E402
from ..adamw import Adam, AdamW, ReferenceAdam, ReferenceAdamW  # noqa: E402
from ..muon import Muon  # noqa: E402
from ..shared.workloads import INIT_STD, SHAPE_SETS, ShapeModel  # noqa: E402
from ..turbo_adam import TurboAdam  # noqa: E402
from ..turbo_adam.optimizer import ReferenceTurboAdam  # noqa: E402
from .bounds import muon_tol  # noqa: E402
from .check import parity_check  # noqa: E402

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


def cells(steps: int):
    """(name, candidate, dtype, shape set, device, oracle, oracle label, tol, extra kwargs, named)."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
    shape_sets = ["small", "single_4096x1024", "llama134m"] if ON_GPU else ["small"]
    device = "cuda" if ON_GPU else "cpu"
    for name, cls in (("AdamW", AdamW), ("Adam", Adam)):
        for dtype in dtypes:
            for shapes in shape_sets:
                yield (name, cls, dtype, shapes, device, *_oracle(name, dtype), TOL[dtype], {}, None)
    yield from adam_mini_cells(device)
    yield from muon_cells(device, steps)
    yield from turbo_adam_cells(device, shape_sets)
    yield from adafactor_cells(device, shape_sets)


class OfficialAdamMini:
    """adam-mini 1.1.1's Adam_mini with its state shown under our keys and shapes: exp_avg
    (the parameter's shape) and exp_avg_sq (one value per block, or per element for biases)."""

    def __init__(self, named_params, momentum_dtype: str = "fp32", **kw) -> None:
        from adam_mini import Adam_mini

        if momentum_dtype != "fp32":
            raise ValueError("adam-mini 1.1.1 keeps momentum in the parameter dtype; compare with fp32")
        self.opt = Adam_mini(named_params, verbose=False, **kw)

    def step(self) -> None:
        self.opt.step()

    @property
    def state(self) -> dict:
        out = {}
        for p, s in self.opt.state.items():
            if "m" in s:
                out[p] = {"exp_avg": s["m"].view(p.shape), "exp_avg_sq": s["v"] if "v" in s else s["vmean"].flatten()}
        return out


# AdamMini: the attention geometry of each Llama-style shape set.
GEOMETRY = {"llama_tiny": dict(dim=32, n_heads=4, n_kv_heads=2), "llama134m": dict(dim=768, n_heads=12)}
# FP8 momentum: a last-bit difference in m may flip an E4M3 rounding (2^-3 of that element),
# rarely; the state comparison (raw FP8 m included) allows that, params move by lr times it.
FP8_TOL = 1e-3


def adam_mini_cells(device: str):
    """AdamMini (fp32 momentum) against its reference and adam-mini 1.1.1 when installed; FP8
    momentum (GPU) against the reference's FP8 path, fp32 and bf16 parameters."""
    named = ShapeModel.named
    for shapes in ["llama_tiny", "llama134m"] if ON_GPU else ["llama_tiny"]:
        kw = dict(GEOMETRY[shapes], momentum_dtype="fp32")
        yield ("AdamMini", AdamMini, torch.float32, shapes, device, ReferenceAdamMini, "reference", TOL[torch.float32],
               kw, named)  # fmt: skip
        if importlib.util.find_spec("adam_mini") is None:
            print("(AdamMini vs adam-mini 1.1.1: skipped, adam-mini is not installed)")
        else:
            yield ("AdamMini", AdamMini, torch.float32, shapes, device, OfficialAdamMini, "adam-mini 1.1.1", 1e-5,
                   kw, named)  # fmt: skip
        if ON_GPU:
            for dtype in (torch.float32, torch.bfloat16):
                tol = FP8_TOL if dtype == torch.float32 else TOL[dtype]
                yield ("AdamMini8", AdamMini, dtype, shapes, device, ReferenceAdamMini, "reference", tol,
                       dict(GEOMETRY[shapes], momentum_dtype="fp8"), named)  # fmt: skip


def muon_cells(device: str, steps: int):
    """Muon against torch.optim.Muon on the hidden matrices of the Llama-style lists, within the
    bound of our bf16 NS being another rounding of torch's (``bounds.muon_tol``)."""
    for shapes in ["llama_tiny_hidden", "llama134m_hidden"] if ON_GPU else ["llama_tiny_hidden"]:
        tol = muon_tol([s for _, s in SHAPE_SETS[shapes]], HYPER["lr"], steps, INIT_STD)
        yield ("Muon", Muon, torch.float32, shapes, device, torch.optim.Muon, "torch Muon", tol, {}, None)


# TurboAdam's codes: the GPU's approximate log2 and division may move a stochastic rounding by an
# ulp of its threshold, flipping one code byte in about a million a step (a byte's change is a
# few 1e-3 of a code tensor's norm, so a few such flips stay under 1e-2).
TURBO_CODES_TOL = 1e-2


def turbo_adam_cells(device: str, shape_sets: list[str]):
    """TurboAdam with both codecs off against torch AdamW (it is our AdamW then), and with every
    tensor compressed (size thresholds 0, so that the small set's vectors and matrices keep
    codes) against its PyTorch reference; fp32 parameters."""
    for shapes in shape_sets:
        codecs_off = lambda ps, **kw: TurboAdam(ps, compress_m=False, compress_v=False, **kw)  # noqa: E731
        yield ("TurboAdam0", codecs_off, torch.float32, shapes, device, *_oracle("AdamW", torch.float32),
               TOL[torch.float32], {}, None)  # fmt: skip
        yield ("TurboAdam", TurboAdam, torch.float32, shapes, device, ReferenceTurboAdam, "reference",
               TURBO_CODES_TOL, dict(min_m_compress_elements=0, min_v_compress_elements=0), None)  # fmt: skip


def adafactor_cells(device: str, shape_sets: list[str]):
    """Adafactor with fp32 statistics against torch.optim.Adafactor (the kernels add g², u² and p² in
    another order: a few ulps a step), and with 8-bit statistics (and an int8 first moment) against
    its PyTorch path (a code moved by an ulp at a rounding threshold: TURBO_CODES_TOL's reasoning);
    fp32 parameters."""
    for shapes in shape_sets:
        fp32_stats = lambda ps, **kw: Adafactor(ps, state_bits=32, **kw)  # noqa: E731
        torch_adafactor = lambda ps, **kw: torch.optim.Adafactor(ps, foreach=False, **kw)  # noqa: E731
        yield ("Adafactor32", fp32_stats, torch.float32, shapes, device, torch_adafactor, "torch", TOL[torch.float32],
               {}, None)  # fmt: skip
        yield ("Adafactor", Adafactor, torch.float32, shapes, device, ReferenceAdafactor, "reference", TURBO_CODES_TOL,
               {}, None)  # fmt: skip
        # an int8 first moment: an ulp of m at a rounding moves one code (1/127 of its block's largest)
        yield ("AdafM8", Adafactor, torch.float32, shapes, device, ReferenceAdafactor, "reference", TURBO_CODES_TOL,
               {"beta1": 0.9, "momentum_dtype": "int8"}, None)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    where = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton interpreter)"
    print(f"parity matrix on {where}, {args.steps} steps, hyperparameters {HYPER}")
    header = f"{'optimizer':<9} {'dtype':<9} {'shapes':<17} {'oracle':<15} {'worst rel':>10} {'tol':>7}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for name, cls, dtype, shapes, device, ref, oracle, tol, extra, named in cells(args.steps):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no tuned config" is not a failure
            model = lambda shapes=shapes, dtype=dtype, device=device: ShapeModel(  # noqa: E731
                SHAPE_SETS[shapes], dtype=dtype, device=device
            )
            report = parity_check(model, ref, cls, steps=args.steps, tol=tol, named=named, **HYPER, **extra)
        worst = report.worst()
        failures += not report.passed
        result = "pass" if report.passed else f"FAIL ({worst.name} {worst.what})"
        print(f"{name:<9} {str(dtype)[6:]:<9} {shapes:<17} {oracle:<15} {worst.rel:10.2e} "
              f"{tol:7.0e}  {result}  [{time.perf_counter() - t0:.1f}s]")  # fmt: skip
    print(f"{'all cells pass' if not failures else f'{failures} cell(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
