"""parity_check itself: it must be able to fail."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.parity import compare_tensors, parity_check, relative_error


def _model():
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))


def test_identical_optimizers_pass_with_zero_difference():
    report = parity_check(_model, torch.optim.AdamW, torch.optim.AdamW, steps=3)
    assert report.passed and report.worst().rel == 0.0
    assert {r.what for r in report.rows} == {"param", "step", "exp_avg", "exp_avg_sq"}


def test_a_different_optimizer_fails_and_says_where():
    wrong = lambda params, **kw: torch.optim.AdamW(params, **dict(kw, lr=kw["lr"] * 1.1))  # noqa: E731
    report = parity_check(_model, torch.optim.AdamW, wrong, steps=3, tol=1e-6, lr=1e-2)
    assert not report.passed
    assert "FAIL" in str(report) and "NO at" in report.table(failures_only=True)


def test_nan_never_passes():
    row = compare_tensors("x", "param", torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]), tol=1e9)
    assert not row.passed and row.nan_mismatch == 1
    both = compare_tensors("x", "param", torch.tensor([math.nan]), torch.tensor([math.nan]), tol=1e9)
    assert not both.passed


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps"):
        parity_check(_model, torch.optim.AdamW, AdamW, steps=0)


def test_named_optimizers_get_name_parameter_pairs():
    from kernel_factory.optimizers import ReferenceAdamMini

    def model():
        m = torch.nn.Module()
        m.mlp = torch.nn.Linear(6, 4)  # "mlp": per-row blocks; its bias: plain Adam
        return m

    geometry = dict(dim=6, n_heads=2, momentum_dtype="fp32")
    named = lambda m: list(m.named_parameters())  # noqa: E731
    report = parity_check(model, ReferenceAdamMini, ReferenceAdamMini, steps=2, named=named, **geometry)
    assert report.passed and {r.what for r in report.rows} == {"param", "step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(TypeError, match="named parameters"):
        parity_check(model, ReferenceAdamMini, ReferenceAdamMini, steps=1, **geometry)


def test_relative_error_on_the_device_agrees_with_compare_tensors():
    ref = torch.randn(1000, dtype=torch.float64).float()
    cand = ref + 1e-4 * torch.randn(1000)
    assert relative_error(cand, ref) == pytest.approx(compare_tensors("t", "x", cand, ref, 1.0).rel, rel=1e-6)
    assert relative_error(ref.bfloat16(), ref) == pytest.approx(compare_tensors("t", "x", ref.bfloat16(), ref, 1.0).rel,
                                                                rel=1e-6)  # fmt: skip
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0 and relative_error(torch.ones(3), torch.zeros(3)) > 0
    cand[7] = float("nan")
    assert relative_error(cand, ref) == float("inf")
    assert relative_error(ref, cand) == float("inf")  # a NaN in the reference: inf, not a NaN max() may drop
