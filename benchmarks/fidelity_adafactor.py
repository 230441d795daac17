"""How faithfully Adafactor with 8-bit statistics follows Adafactor with fp32 ones on one stream.

    python benchmarks/fidelity_adafactor.py [--steps 2000] [--rows 128] [--cols 512] [--device cpu]

Ours with ``state_bits=8`` against ours with ``state_bits=32`` (torch.optim.Adafactor's arithmetic
bit for bit, ``tests/test_adafactor_cpu.py``), both stepping one parameter on the synthetic stream
of ``benchmarks/fidelity.py`` (signal + noise at SNR 0.3, per-row scales spread over 0, 1 or 2
decades), its rows either growing by 1-10x over the run at different rates or stationary, at
magnitudes 1e-2, 1e-7 and 1e-15 (g² down to 1e-30). The gradient does not depend on the parameter
and weight decay is 0, so the parameter is zeroed before each step and the update is minus the
parameter after it. Reported at 250, 500, 1000 and 2000 steps: the update's cosine with the fp32
run's and its norm ratio, and for the row and column statistics the median of stored / exact and
the rms of |ln(stored / exact)|.

Where adafactor8bit is installed (its PyTorch path runs on the CPU), it steps the same stream with
``relative_step=False``; its statistics, decoded by its documented codec (code 0 is 0, code q > 0
is 2^((q - 1) scale / 254 + min_log) per block), are held against exact fp64 EMAs of its own
definition (the row and column means of g² plus its eps1 = 1e-30, with weight t^-0.8, as torch's).
Its update is not compared: its step size (no min(lr, 1/sqrt t)) and eps differ from torch's by
design, not by its codec.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.fidelity import CHECKPOINTS, SPREADS, add_common_arguments, stream, write_results  # noqa: E402
from kernel_factory.optimizers import Adafactor  # noqa: E402

MAGNITUDES = (1e-2, 1e-7, 1e-15)
PEER_EPS1 = 1e-30  # adafactor8bit adds it to the means of g² (its eps1 default)
HYPER = dict(lr=1e-2, weight_decay=0.0)


def _log_ratio(stored: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(median, rms |ln|) of stored / exact over elements where both are positive."""
    both = (stored > 0) & (exact > 0)
    r = torch.log(stored.double()[both] / exact.double()[both])
    return float(r.median().exp()), float(r.pow(2).mean().sqrt())


def measure(shape, steps: int, spread: float, magnitude: float, trends: bool, device: str) -> dict[int, tuple]:
    exact_p = torch.nn.Parameter(torch.zeros(shape, device=device))
    p = torch.nn.Parameter(torch.zeros(shape, device=device))
    exact, opt = Adafactor([exact_p], state_bits=32, **HYPER), Adafactor([p], state_bits=8, **HYPER)
    out = {}
    for t, g in enumerate(stream(shape, steps, spread, magnitude, device, trends=trends), 1):
        for q, o in ((exact_p, exact), (p, opt)):
            with torch.no_grad():
                q.zero_()
            q.grad = g.clone()
            o.step()
        if t in CHECKPOINTS:
            u, ue = -p.detach().double(), -exact_p.detach().double()
            cosine, ratio = float((u * ue).sum() / (u.norm() * ue.norm())), float(u.norm() / ue.norm())
            mine, theirs = opt.decoded_state(p), exact.decoded_state(exact_p)
            out[t] = (cosine, ratio, *_log_ratio(mine["row_var"], theirs["row_var"]),
                      *_log_ratio(mine["col_var"], theirs["col_var"]))  # fmt: skip
    return out


def _peer_statistics(opt, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """adafactor8bit's row_var and col_var of ``p``, decoded (fp64) from its codes by its formula:
    per block, code 0 is 0 and code q > 0 is 2^((q - 1) scale / 254 + min_log)."""
    state, out = opt.state[p], {}
    for name in ("row_var", "col_var"):
        scale, low = state[f"{name}_scale"].double(), state[f"{name}_min_log"].double()
        q = state[f"{name}_q"].double().reshape(scale.numel(), -1)
        v = torch.where(q > 0, torch.exp2((q - 1) * scale[:, None] / 254 + low[:, None]), 0.0).reshape(-1)
        out[name] = v[: v.numel() - state[f"{name}_pad"]].view(state[f"{name}_shape"])
    return out


def measure_peer(shape, steps: int, spread: float, magnitude: float, trends: bool, device: str) -> dict[int, tuple]:
    """adafactor8bit's statistics against exact fp64 EMAs of its definition: (nan, nan, median and rms
    ln of row_var, of col_var) at each checkpoint."""
    import adafactor8bit

    p = torch.nn.Parameter(torch.zeros(shape, device=device))
    opt = adafactor8bit.Adafactor8Bit([p], lr=HYPER["lr"], weight_decay=0.0, relative_step=False)
    row = col = None
    out = {}
    for t, g in enumerate(stream(shape, steps, spread, magnitude, device, trends=trends), 1):
        with torch.no_grad():
            p.zero_()
        p.grad = g.clone()
        opt.step()
        sq, w = g.double().square(), t**-0.8
        row_now, col_now = sq.mean(-1, keepdim=True) + PEER_EPS1, sq.mean(-2, keepdim=True) + PEER_EPS1
        row = row_now if row is None else row + w * (row_now - row)
        col = col_now if col is None else col + w * (col_now - col)
        if t in CHECKPOINTS:
            mine = _peer_statistics(opt, p)
            out[t] = (float("nan"), float("nan"), *_log_ratio(mine["row_var"], row), *_log_ratio(mine["col_var"], col))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    args = ap.parse_args(argv)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    lines = [f"Fidelity of 8-bit Adafactor statistics against fp32 ones: one {args.rows} x {args.cols} parameter, "
             f"{where}", "", "| subject | rows | spread (decades) | magnitude | step | update cosine | norm ratio | "
             "median row_var ratio | rms ln row_var | median col_var ratio | rms ln col_var |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    subjects = {"ours (state_bits=8)": measure}
    if importlib.util.find_spec("adafactor8bit") is not None:
        subjects["adafactor8bit"] = measure_peer
    for name, run in subjects.items():
        for trends in (True, False):
            for spread in SPREADS:
                for magnitude in MAGNITUDES:
                    result = run((args.rows, args.cols), args.steps, spread, magnitude, trends, args.device)
                    for t, values in result.items():
                        cells = " | ".join("" if v != v else f"{v:.3f}" for v in values)  # (nan: not compared)
                        lines.append(f"| {name} | {'1-10x trends' if trends else 'stationary'} | {spread} | "
                                     f"{magnitude:g} | {t} | {cells} |")  # fmt: skip
                    print(lines[-1], flush=True)
    write_results(lines, argv, "benchmarks/fidelity_adafactor.py", args.out / f"fidelity_adafactor_{args.device}.md")


if __name__ == "__main__":
    main()
