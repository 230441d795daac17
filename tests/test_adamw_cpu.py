"""CPU tier, default backend: torch's fused CPU kernel underneath, torch.optim's contract on top."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from tolerances import adam_drift_atol, drift_tol
from twin_training import check_scaler_parity

from kernel_factory.optimizers import Adam, AdamW
from kernel_factory.optimizers.shared import buckets
from kernel_factory.optimizers.shared.checks import check_param_grad
from kernel_factory.optimizers.shared.workloads import SHAPE_SETS, ShapeModel


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "auto")


def _groups(model, spec):
    params = list(model.parameters())
    return [dict(params=params[i::len(spec)], **kw) for i, kw in enumerate(spec)]


def _train(model, opt, steps, seed=0, scaler=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cls,ref,kwargs",
    [
        (AdamW, torch.optim.AdamW, {}),
        (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0, amsgrad=True)),
        (AdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, maximize=True)),
        (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ],
)
def test_bitwise_equal_to_torch_fused_cpu(dtype, cls, ref, kwargs):
    a = ShapeModel(SHAPE_SETS["small"], dtype=dtype)
    b = copy.deepcopy(a)
    ours, theirs = cls(a.parameters(), **kwargs), ref(b.parameters(), fused=True, **kwargs)
    _train(a, ours, 7)
    _train(b, theirs, 7)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in theirs.state[q].items():
            assert torch.equal(ours.state[p][key], value), key


def test_param_groups_with_different_hyperparameters_are_bitwise_equal():
    spec = [dict(lr=1e-2, weight_decay=0.0), dict(lr=1e-3, weight_decay=0.2, amsgrad=True, betas=(0.5, 0.9))]
    a = ShapeModel(SHAPE_SETS["small"])
    b = copy.deepcopy(a)
    ours, theirs = AdamW(_groups(a, spec)), torch.optim.AdamW(_groups(b, spec), fused=True)
    _train(a, ours, 5)
    _train(b, theirs, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


BAD = [
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(lr=torch.tensor([1.0, 2.0])), "1-element"),
    (dict(eps=-1e-8), "Invalid epsilon"),
    (dict(betas=(1.0, 0.999)), "index 0"),
    (dict(betas=(0.9, -0.1)), "index 1"),
    (dict(weight_decay=-0.1), "weight_decay"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_hyperparameters_raise_value_error_like_torch(kwargs, message):
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=message):
        torch.optim.AdamW(p, **kwargs)
    with pytest.raises(ValueError, match=message):
        AdamW(p, **kwargs)


def test_implementation_flags_are_checked():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="differentiable"):
        AdamW(p, differentiable=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        AdamW(p, foreach=True, fused=True)
    with pytest.raises(TypeError, match="foreach"):
        AdamW(p, foreach="yes")
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW(p, state_dtype="fp8")
    AdamW(p, foreach=False, fused=True, capturable=False)  # accepted


@pytest.mark.parametrize(
    "grad,error,message",
    [
        (torch.zeros(4, 3), ValueError, "grad shape"),
        (torch.zeros(3, 4, dtype=torch.float64), TypeError, "grad dtype"),
        (torch.zeros(3, 4).to_sparse(), RuntimeError, "sparse"),
    ],
)
def test_bad_gradients_name_the_parameter(grad, error, message):
    # torch refuses to *assign* a grad of another shape or dtype, so the check is called
    # directly here; a sparse grad can be assigned and goes through step().
    p = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(error, match=f"parameter 7.*{message}"):
        check_param_grad(7, p, grad)
    if grad.is_sparse:
        opt = AdamW([p])
        p.grad = grad
        with pytest.raises(error, match=f"parameter 0.*{message}"):
            opt.step()


def test_complex_parameters_are_rejected():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = AdamW([p])
    p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match="complex"):
        opt.step()


def test_non_contiguous_parameter_is_updated_correctly(monkeypatch):
    # the warning is once per process: a test before this one in the same worker may have had it
    monkeypatch.setattr(buckets, "_warned", set())
    base = torch.randn(6, 5)
    p = torch.nn.Parameter(base.t())  # a transposed view: not contiguous
    q = torch.nn.Parameter(base.t().contiguous())
    ours, theirs = AdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)
    with pytest.warns(RuntimeWarning, match="non-contiguous"):
        for _ in range(3):
            g = torch.randn(5, 6)
            p.grad, q.grad = g.clone(), g.clone()
            ours.step()
            theirs.step()
    # Our reference path and torch's for-loop path: another kernel, ulps apart per step.
    torch.testing.assert_close(p, q, rtol=drift_tol(3), atol=adam_drift_atol(3, lr=1e-2))


def _roundtrip(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("first,second", [(torch.optim.AdamW, AdamW), (AdamW, torch.optim.AdamW)])
def test_state_dict_interchange_then_identical_training(first, second):
    spec = [dict(lr=1e-2), dict(lr=1e-3, amsgrad=True)]
    a = ShapeModel(SHAPE_SETS["small"])
    src = first(_groups(a, spec), fused=True) if first is torch.optim.AdamW else first(_groups(a, spec))
    _train(a, src, 4)
    state = _roundtrip(src)
    assert set(state["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
    b = copy.deepcopy(a)
    dst = second(_groups(b, spec), fused=True) if second is torch.optim.AdamW else second(_groups(b, spec))
    dst.load_state_dict(state)
    _train(a, src, 6, seed=1)
    _train(b, dst, 6, seed=1)
    # torch.optim takes `fused` from the checkpoint's param groups: loading ours (fused=None)
    # moves torch to its for-loop path, whose rounding differs from its fused CPU kernel's by
    # ulps per step (by how much depends on the CPU's SIMD width); our direction keeps torch's
    # fused kernel underneath and is bitwise.
    exact = second is AdamW
    rtol, atol = (0, 0) if exact else (drift_tol(6), adam_drift_atol(6, lr=max(g["lr"] for g in spec)))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol)
        assert float(dst.state[q]["step"]) == 10.0


def test_fp32_state_survives_a_checkpoint_round_trip():
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    opt = AdamW([p], state_dtype="fp32", lr=1e-2)
    _train(torch.nn.ParameterList([p]), opt, 3)
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    saved = _roundtrip(opt)
    clone = AdamW([p], state_dtype="fp32", lr=1e-2)
    clone.load_state_dict(saved)
    assert torch.equal(clone.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert clone.state[p]["exp_avg"].dtype == torch.float32


def test_lr_scheduler_and_closure():
    model = torch.nn.Linear(4, 2)
    opt = AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    losses = []
    for _ in range(3):
        losses.append(float(opt.step(closure).detach()))
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert losses[-1] < losses[0]


def test_params_without_grads_are_skipped_like_torch():
    a = ShapeModel(SHAPE_SETS["small"])
    b = copy.deepcopy(a)
    ours, theirs = AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        for i, (p, q) in enumerate(zip(a.parameters(), b.parameters(), strict=True)):
            has_grad = (i + step) % 2 == 0  # the set of params with grads changes every step
            p.grad = torch.randn_like(p) if has_grad else None
            q.grad = p.grad.clone() if has_grad else None
        ours.step()
        theirs.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]["step"], theirs.state[q]["step"])


def test_grad_scaler_skips_the_step_on_inf():
    check_scaler_parity(torch.nn.Linear(8, 4), "cpu", tol=0)
