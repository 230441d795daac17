"""CPU tier, Triton backend: the generated single-tensor kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import drift_tol
from twin_training import check_scaler_parity, twin_steps

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers import Adam, AdamW, ReferenceAdamW
from kernel_factory.optimizers.adamw.plan import TritonSingleTensor
from kernel_factory.optimizers.parity import compare_tensors, parity_check
from kernel_factory.optimizers.shared.workloads import SHAPE_SETS, ShapeModel

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")

# fp32: ours follows torch's operation order with fp64 bias corrections, another kernel (numpy's
# under the interpreter, torch's vectorized CPU ops): an ulp per step at most, 20 steps (measured
# near 1.3e-7). fp16: storage rounds each step to 11 bits; one flipped rounding is 5e-4 of an
# element, far less normwise.
FP32_TOL, FP16_TOL = drift_tol(20), 1e-3


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")


CASES = [
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (AdamW, torch.optim.AdamW, dict(lr=5e-3, betas=(0.0, 0.99), maximize=True)),
    (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
]


@pytest.mark.parametrize("cls,ref,kwargs", CASES)
def test_fp32_within_an_ulp_per_step_of_torch_after_20_steps(cls, ref, kwargs):
    report = parity_check(lambda: ShapeModel(SHAPE_SETS["small"]), ref, cls, steps=20, tol=FP32_TOL, **kwargs)
    assert report.passed, str(report)


def test_fp16_params_match_the_fp32_math_reference():
    # torch's CPU kernel computes fp16 in half precision (eps=1e-8 underflows to 0 and it
    # returns -inf), so the oracle is our reference, which upcasts like the kernel.
    report = parity_check(lambda: ShapeModel(SHAPE_SETS["small"], dtype=torch.float16),
                          ReferenceAdamW, AdamW, steps=20, tol=FP16_TOL, lr=1e-2, weight_decay=0.1)  # fmt: skip
    assert report.passed, str(report)


def test_param_groups_with_different_hyperparameters():
    a = ShapeModel(SHAPE_SETS["small"])
    b = copy.deepcopy(a)
    spec = [dict(lr=1e-2), dict(lr=1e-3, weight_decay=0.0, amsgrad=True), dict(betas=(0.5, 0.9), eps=1e-3)]
    groups = lambda m: [dict(params=list(m.parameters())[i::3], **kw) for i, kw in enumerate(spec)]  # noqa: E731
    ours, theirs = AdamW(groups(a)), torch.optim.AdamW(groups(b))
    twin_steps(a, ours, b, theirs, 20)
    assert all(isinstance(bk, TritonSingleTensor) for plan in ours._plans.values() for bk in plan.buckets)
    assert len(ours._plans) == 3
    # Normwise over all parameters: a one-element tensor that steps of lr 1e-2 carry near zero
    # keeps the absolute rounding of those steps (~1e-9), which relative to its own tiny norm
    # can exceed the relative bound on unlucky draws.
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert compare_tensors("all", "param", flat(a), flat(b), FP32_TOL).passed


def test_grad_scaler_unscales_in_kernel_and_skips_on_inf():
    check_scaler_parity(torch.nn.Linear(16, 8), "cpu", tol=FP32_TOL)


def test_triton_backend_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamW([p])
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        opt.step()
