"""Parity: run a reference and a candidate optimizer on identical model copies with the same
fresh random gradients, and report how far parameters and state drifted apart.

    report = parity_check(lambda: MyModel(), torch.optim.AdamW, AdamW, steps=5, lr=1e-3)
    assert report.passed, report

Relative difference is normwise, ||cand - ref|| / ||ref|| in float64 (``max_abs`` and
``where`` locate the worst element); a NaN in the candidate, or NaN where the reference
has none, always fails.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ParityRow:
    """One compared tensor: a parameter (``what='param'``) or one of its state entries."""

    name: str
    what: str
    max_abs: float
    rel: float
    where: tuple[int, ...]
    nan_mismatch: int
    passed: bool


@dataclass
class ParityReport:
    rows: list[ParityRow] = field(default_factory=list)
    tol: float = 1e-3
    steps: int = 0

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def worst(self) -> ParityRow:
        return max(self.rows, key=lambda r: (not r.passed, r.rel))

    def table(self, failures_only: bool = False) -> str:
        lines = [f"{'name':<40} {'what':<15} {'max_abs':>10} {'rel':>10} {'nan':>4}  ok"]
        for r in self.rows:
            if failures_only and r.passed:
                continue
            lines.append(f"{r.name:<40} {r.what:<15} {r.max_abs:10.3e} {r.rel:10.3e} "
                         f"{r.nan_mismatch:4d}  {'yes' if r.passed else 'NO at ' + str(r.where)}")  # fmt: skip
        return "\n".join(lines)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if not self.rows:
            return f"parity {verdict}: nothing compared"
        w = self.worst()
        return (f"parity {verdict} after {self.steps} steps, tol {self.tol:g}: worst {w.name} "
                f"{w.what} rel {w.rel:.3e}\n{self.table(failures_only=not self.passed)}")  # fmt: skip


def compare_tensors(name: str, what: str, cand: Tensor, ref: Tensor, tol: float) -> ParityRow:
    """Compare ``cand`` with ``ref`` (any shapes equal, any float dtypes) into a ParityRow."""
    if cand.shape != ref.shape:
        raise ValueError(f"{name} {what}: shape {tuple(cand.shape)} != reference {tuple(ref.shape)}")
    c, r = cand.detach().double().cpu().reshape(ref.shape), ref.detach().double().cpu()
    nan_c, nan_r = torch.isnan(c), torch.isnan(r)
    nan_mismatch = int((nan_c != nan_r).sum())  # a NaN in both still fails, below
    diff = (c - r).abs().nan_to_num(nan=float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    ref_norm = float(r.nan_to_num().norm())
    err_norm = float((c - r).nan_to_num(nan=float("inf")).norm())
    rel = err_norm / ref_norm if ref_norm > 0 else err_norm
    passed = nan_mismatch == 0 and not bool(nan_c.any()) and rel <= tol
    return ParityRow(name, what, max_abs, rel, where, nan_mismatch, passed)


def relative_error(cand: Tensor, ref: Tensor) -> float:
    """||cand - ref|| / ||ref|| (||cand - ref|| where ref is 0) on the tensors' device, summed in
    fp64; inf where cand or the result is not finite. The difference is taken in fp32, exact for
    the close values a check compares (Sterbenz). ``compare_tensors`` copies both to the host in fp64: for a
    tuner trial on a billion parameters that copy took most of the trial."""
    c, r = cand.detach().float().reshape(ref.shape), ref.detach().float()
    err = float(torch.linalg.vector_norm(c - r, dtype=torch.float64))
    norm = float(torch.linalg.vector_norm(r, dtype=torch.float64))
    rel = err / norm if norm > 0 else err
    return rel if math.isfinite(rel) else math.inf  # inf or NaN anywhere: never a pass, nor a NaN for max()


def _state_tensors(state: dict) -> dict[str, Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def parity_check(
    model_factory: Callable[[], nn.Module],
    reference_cls: Callable[..., torch.optim.Optimizer],
    candidate_cls: Callable[..., torch.optim.Optimizer],
    steps: int = 5,
    tol: float = 1e-3,
    *,
    seed: int = 0,
    named: Callable[[nn.Module], list[tuple[str, torch.Tensor]]] | None = None,
    **optimizer_kwargs,
) -> ParityReport:
    """Step ``reference_cls`` and ``candidate_cls`` ``steps`` times on two identical copies of
    ``model_factory()`` with identical fresh N(0, 1) gradients (in each parameter's dtype and
    device), then compare every parameter and every state tensor the reference keeps.
    ``named(model)``, when given, builds both optimizers from (name, parameter) pairs (for
    optimizers that partition by name, e.g. AdamMini)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ref_model = model_factory()
    cand_model = copy.deepcopy(ref_model)
    ref_params = dict(ref_model.named_parameters())
    cand_params = dict(cand_model.named_parameters())
    if named is None:
        ref_opt = reference_cls(ref_params.values(), **optimizer_kwargs)
        cand_opt = candidate_cls(cand_params.values(), **optimizer_kwargs)
    else:
        ref_opt = reference_cls(named(ref_model), **optimizer_kwargs)
        cand_opt = candidate_cls(named(cand_model), **optimizer_kwargs)
    generators: dict[torch.device, torch.Generator] = {}
    for _ in range(steps):
        for name, rp in ref_params.items():
            gen = generators.get(rp.device)
            if gen is None:
                gen = generators[rp.device] = torch.Generator(device=rp.device).manual_seed(seed)
            g = torch.randn(rp.shape, generator=gen, device=rp.device, dtype=torch.float32)
            rp.grad = g.to(rp.dtype)
            cand_params[name].grad = g.to(rp.dtype)
        ref_opt.step()
        cand_opt.step()
    report = ParityReport(tol=tol, steps=steps)
    for name, rp in ref_params.items():
        cp = cand_params[name]
        report.rows.append(compare_tensors(name, "param", cp, rp, tol))
        cand_state = _state_tensors(cand_opt.state.get(cp, {}))
        for key, ref_t in _state_tensors(ref_opt.state.get(rp, {})).items():
            if key not in cand_state:
                raise KeyError(f"{name}: candidate state has no {key!r} (has {sorted(cand_state)})")
            report.rows.append(compare_tensors(name, key, cand_state[key], ref_t, tol))
    return report
