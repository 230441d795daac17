"""How faithfully a compressed Adam follows exact AdamW on the same gradient stream.

    python benchmarks/fidelity.py [--steps 2000] [--rows 128] [--cols 512] [--device cpu]
        [--column-spread 0]

Every subject (ours: TurboAdam at its default, v-only and m-only; peers where installed: turboadam,
flashoptim, torchao's AdamW4bit on CUDA) and exact fp32 AdamW step one parameter on the same
synthetic stream. The gradient does not depend on the parameter and weight decay is 0, so the
parameter is zeroed before each step and the update is minus the parameter after it, exactly.

The stream: per element a fixed signal plus fresh Gaussian noise with signal/noise 0.3, times a
per-row scale spread log-uniformly over 0, 1 or 2 decades, times a per-row trend growing by 1-10x
over the run, at an overall magnitude of 1e-2 or 1e-7; ``--column-spread D`` also scales each
column by a fixed factor spread log-uniformly over D decades (the input features of a layer, so
the elements of one 128-block differ in size). Reported at 250, 500, 1000 and 2000 steps:
the update's cosine with exact AdamW's and its norm ratio, and, where the subject exposes its
decoded second moment, the median of stored / exact v and the rms of |ln(stored / exact)|.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from kernel_factory.optimizers import TurboAdam  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fidelity"
CHECKPOINTS = (250, 500, 1000, 2000)
SPREADS = (0, 1, 2)
MAGNITUDES = (1e-2, 1e-7)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def stream(shape: tuple[int, int], steps: int, spread: float, magnitude: float, device: str,
           seed: int = 0, trends: bool = True, column_spread: float = 0.0) -> Iterator[torch.Tensor]:  # fmt: skip
    """The synthetic gradients of the module docstring, fp32 ``shape``, one per step (``trends``
    false: every row stationary; ``column_spread``: decades the columns' fixed scales span)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    row_scale = 10 ** (torch.rand(rows, 1, generator=gen) * spread)
    if column_spread:  # drawn from a generator of its own: the rows' stream stays the one without
        row_scale = row_scale * 10 ** (torch.rand(1, cols, generator=torch.Generator().manual_seed(seed + 1))
                                       * column_spread)  # fmt: skip
    trend = 1 + 9 * torch.rand(rows, 1, generator=gen)  # this row grows by 1-10x over the run
    trend = trend if trends else torch.ones_like(trend)
    signal = 0.3 * torch.randn(shape, generator=gen)
    for t in range(steps):
        scale = magnitude * row_scale * trend ** (t / max(steps - 1, 1))
        yield (scale * (signal + torch.randn(shape, generator=gen))).to(device)


class Subject:
    """An optimizer over one parameter and, where it has one, a way to read its decoded v."""

    def __init__(self, make: Callable[[list], torch.optim.Optimizer], v_of: Callable | None = None) -> None:
        self.make, self.v_of = make, v_of  # v_of(optimizer, param) -> decoded v like the param


def subjects() -> dict[str, Subject]:
    """Ours, and the peers importable here."""
    ours = lambda **kw: Subject(lambda ps: TurboAdam(ps, **HYPER, **kw),  # noqa: E731
                                lambda opt, p: opt.decoded_state(p)["exp_avg_sq"])  # fmt: skip
    out = {"TurboAdam (default)": ours(), "TurboAdam v-only": ours(compress_m=False),
           "TurboAdam m-only": ours(compress_v=False), "TurboAdam v_bits=4": ours(v_bits=4),
           "TurboAdam v_bits=8": ours(v_bits=8)}  # fmt: skip
    try:
        import turboadam

        out["turboadam (default)"] = Subject(lambda ps: turboadam.TurboAdam(ps, **HYPER))
    except ImportError:
        pass
    try:
        import flashoptim

        # master_weight_bits=None: fp32 params (flashoptim refuses its 24-bit default for them)
        out["flashoptim FlashAdamW"] = Subject(lambda ps: flashoptim.FlashAdamW(ps, master_weight_bits=None, **HYPER))
    except ImportError:
        pass
    if torch.cuda.is_available():
        try:
            from torchao.optim import AdamW4bit

            out["torchao AdamW4bit"] = Subject(lambda ps: AdamW4bit(ps, **HYPER))
        except ImportError:
            pass
    return out


def measure(subject: Subject, shape, steps: int, spread: float, magnitude: float, device: str,
            column_spread: float = 0.0) -> dict[int, tuple]:  # fmt: skip
    exact_p = torch.nn.Parameter(torch.zeros(shape, device=device))
    p = torch.nn.Parameter(torch.zeros(shape, device=device))
    exact = torch.optim.AdamW([exact_p], foreach=False, **HYPER)
    opt = subject.make([p])
    out = {}
    for t, g in enumerate(stream(shape, steps, spread, magnitude, device, column_spread=column_spread), 1):
        for q, o in ((exact_p, exact), (p, opt)):
            with torch.no_grad():
                q.zero_()
            q.grad = g.clone()
            o.step()
        if t in CHECKPOINTS:
            u, ue = -p.detach().double(), -exact_p.detach().double()
            cosine = float((u * ue).sum() / (u.norm() * ue.norm()))
            ratio = float(u.norm() / ue.norm())
            median = rms = float("nan")
            if subject.v_of is not None:
                v, ve = subject.v_of(opt, p).double(), exact.state[exact_p]["exp_avg_sq"].double()
                both = (v > 0) & (ve > 0)
                log_ratio = torch.log(v[both] / ve[both])
                median, rms = float(log_ratio.median().exp()), float(log_ratio.pow(2).mean().sqrt())
            out[t] = (cosine, ratio, median, rms)
    return out


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """The fidelity scripts' shared options: --steps, --rows, --cols, --device, --out."""
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)


def write_results(lines: list[str], argv: list[str] | None, script: str, path: Path) -> None:
    """``lines`` and the command that made them (``script`` and its arguments; the output folder
    is the runner's own, left out) to ``path``."""
    given = list(argv or sys.argv[1:])
    shown = [a for i, a in enumerate(given) if not a.startswith("--out") and (i == 0 or given[i - 1] != "--out")]
    lines = [*lines, "", f"Command: python {script} {shlex.join(shown)}".strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap)
    ap.add_argument("--subjects", default=None, help="comma-separated names (default: all available)")
    ap.add_argument("--column-spread", type=float, default=0.0, help="decades the columns' scales span")
    args = ap.parse_args(argv)
    available = subjects()
    names = args.subjects.split(",") if args.subjects else list(available)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    columns = f", columns spread over {args.column_spread:g} decades" if args.column_spread else ""
    lines = [f"Fidelity against exact AdamW: one {args.rows} x {args.cols} parameter, {where}{columns}",
             "", "| subject | spread (decades) | magnitude | step | update cosine | norm ratio | median v ratio | "
             "rms ln v ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in names:
        for spread in SPREADS:
            for magnitude in MAGNITUDES:
                result = measure(available[name], (args.rows, args.cols), args.steps, spread, magnitude, args.device,
                                 args.column_spread)  # fmt: skip
                for t, (cosine, ratio, median, rms) in result.items():
                    lines.append(f"| {name} | {spread} | {magnitude:g} | {t} | {cosine:.3f} | {ratio:.3f} | "
                                 f"{median:.3f} | {rms:.3f} |")  # fmt: skip
                print(lines[-1], flush=True)
    suffix = f"_columns{args.column_spread:g}" if args.column_spread else ""
    write_results(lines, argv, "benchmarks/fidelity.py", args.out / f"fidelity_{args.device}{suffix}.md")


if __name__ == "__main__":
    main()
