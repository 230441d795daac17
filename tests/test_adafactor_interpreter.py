"""Adafactor's fused kernels (single-tensor variant) under TRITON_INTERPRET=1 against its PyTorch
path (torch.optim.Adafactor's ops with ``state_bits=32``).

The kernels add g², u² and p² in another order than torch's norms and take the row's part of the
estimate as one division a row, so fp32 results differ by a few ulps a step; the 8-bit codes use
the same hash, grid and rounding, and come out equal unless such an ulp straddles a rounding
threshold (the bound on differing codes allows for that, not more)."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers.adafactor import Adafactor, ReferenceAdafactor
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
# Normwise on the params' change over 3 steps: fp32 sums in another order (a few ulps of the
# statistics, of RMS(u) and RMS(p), so of every element's update).
FP32_TOL = 1e-5
CODE_FLIPS = 1e-3  # fraction of code bytes a one-ulp difference may move
# a matrix whose columns end inside a stats stripe and a tile, a tall one of several stats bands,
# a vector of 4096+ (8-bit codes), a short vector and a scalar (fp32 variance)
SHAPES = [(300, 200), (700, 130), (5000,), (40,), ()]


def _pair(monkeypatch, shapes, steps=3, dtype=torch.float32, oracle_dtype=None, **kw):
    """The same params stepped by the kernels (``dtype``) and by the PyTorch path (``oracle_dtype``,
    the same by default); returns both optimizers, both param lists and the initial values."""
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) * 0.1 for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone().to(oracle_dtype or dtype)) for t in init]
    kw = {"lr": 1e-2, "weight_decay": 0.1, **kw}
    ours, ref = Adafactor(a, **kw), ReferenceAdafactor(b, **kw)
    for step in range(steps):
        for p, q in zip(a, b, strict=True):
            scale = torch.logspace(-3, 0, p.shape[0])[:, None] if p.dim() == 2 else 1.0  # rows over 3 decades
            g = (torch.randn(p.shape, generator=gen) * scale * (1 + step)).to(dtype)
            p.grad, q.grad = g.clone(), g.clone().to(q.dtype)
        ours.step()
        ref.step()
    return ours, ref, a, b, init


def _assert_close(ours, ref, a, b, init, tol=FP32_TOL):
    for i, (p, q, p0) in enumerate(zip(a, b, init, strict=True)):
        row = compare_tensors(f"p{i}", "update", (p - p0).float(), (q.float() - p0.float()), tol)
        assert row.passed, row
        s, r = ours.state[p], ref.state[q]
        assert s.keys() == r.keys()
        for key in s:
            assert s[key].dtype == r[key].dtype and s[key].shape == r[key].shape, key
            if s[key].dtype in (torch.uint8, torch.int16, torch.int8):
                assert (s[key] != r[key]).float().mean() <= CODE_FLIPS, (i, key)
            elif key == "step":
                assert torch.equal(s[key], r[key]), (i, key)
            else:
                assert compare_tensors(f"p{i}", key, s[key].float().reshape(-1), r[key].float().reshape(-1),
                                       tol).passed, (i, key)  # fmt: skip


@pytest.mark.parametrize("state_bits", [8, 32])
def test_kernels_follow_the_pytorch_path(monkeypatch, state_bits):
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES, state_bits=state_bits)
    (plan,) = ours._plans.values()
    assert not plan.reference and len(plan.launches) == 1
    assert plan.launches[0].variant["state_codec"] == ("log8" if state_bits == 8 else "fp32")
    _assert_close(ours, ref, a, b, init)
    s_ours, s_ref = ours.telemetry.summary(), ref.telemetry.summary()
    assert s_ours["amax_update"] == pytest.approx(s_ref["amax_update"], rel=1e-5) and s_ours["amax_update"] > 0


@pytest.mark.parametrize("state_bits", [8, 32])
def test_a_first_moment_follows_the_pytorch_path(monkeypatch, state_bits):
    # fp32 momentum: the interpreter's bf16 stores truncate (the GPU tier takes bf16)
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES, state_bits=state_bits, beta1=0.9, momentum_dtype="fp32")
    assert ours._plans[0].launches[0].variant["momentum"] == "float32"
    _assert_close(ours, ref, a, b, init)
    assert ours.state[a[0]]["exp_avg"].dtype == torch.float32


def test_an_int8_first_moment_follows_the_pytorch_path(monkeypatch):
    """Codes and bf16 block scales as log_codes.encode_linear makes them (a tile's blocks, a
    vector's sub-tiles, a partial last block of a row and of a vector)."""
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES, beta1=0.9, momentum_dtype="int8")
    assert ours._plans[0].launches[0].variant["momentum"] == "int8"
    # an ulp of m that straddles a rounding moves a code by one (1/127 of its block's largest value),
    # and p with it: one such code in 60000 values is 1.6e-5 of the update's norm
    _assert_close(ours, ref, a, b, init, tol=1e-4)
    state = ours.state[a[0]]
    assert state["exp_avg_codes"].dtype == torch.int8 and state["exp_avg_scale"].shape == (300, 2)
    assert int(state["exp_avg_codes"].abs().max()) == 127  # every block's largest value takes the top code


def test_maximize_eps_and_clipping_threshold(monkeypatch):
    # d = 1.2 clips RMS(u) (about 1 by construction) on some steps only; eps1 = 1e-6 floors rows of 1e-3
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES[:3], maximize=True, eps=(1e-6, 1e-2), d=1.2,
                                  beta2_decay=-0.5)  # fmt: skip
    _assert_close(ours, ref, a, b, init)


def test_half_params_round_once_against_fp32_arithmetic(monkeypatch):
    """fp16 params (the interpreter's bf16 stores truncate; the GPU tier takes bf16): the kernels'
    update is the fp32 arithmetic of the same fp16 values, rounded once to fp16 (torch rounds after
    the decay and again after the update): within half an fp16 ulp (2^-11 relative, 2^-25 among
    subnormals) of the PyTorch path run in fp32 on the same values, plus fp32's ulps of the update."""
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES[:3], steps=1, dtype=torch.float16,
                                  oracle_dtype=torch.float32, eps=(1e-30, 1e-3))  # fmt: skip
    for p, q, p0 in zip(a, b, init, strict=True):
        p, q = p.detach().float(), q.detach()
        slack = 2**-11 * q.abs() + 2**-25 + FP32_TOL * (q - p0.float()).abs().max()
        assert bool(((p - q).abs() <= slack).all())


def test_grad_scaler_tensors_unscale_and_skip(monkeypatch):
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES[:3], steps=1)
    before = [p.detach().clone() for p in a]
    state = {k: t.clone() for k, t in ours.state[a[0]].items()}
    for p in a:
        p.grad = torch.randn(p.shape) * 1024
    ours.grad_scale, ours.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    ours.step()  # an inf: nothing moves, the step count included
    assert all(torch.equal(p, q) for p, q in zip(a, before, strict=True))
    assert all(torch.equal(t, ours.state[a[0]][k]) for k, t in state.items())
    for p, q in zip(a, b, strict=True):  # the same grads, scaled by 1024 for ours
        q.grad = p.grad / 1024
    ours.found_inf = torch.tensor(0.0)
    ours.step()
    ref.step()
    _assert_close(ours, ref, a, b, init)
    assert ours.telemetry.summary()["skipped_steps"] == 1


def test_a_tensor_of_three_dims_takes_the_pytorch_path_beside_the_kernels(monkeypatch):
    ours, ref, a, b, init = _pair(monkeypatch, [(3, 40, 50), (64, 130)], steps=2)
    (plan,) = ours._plans.values()
    assert plan.reference == [0] and len(plan.launches) == 1
    _assert_close(ours, ref, a, b, init)


def test_a_state_dict_round_trip_continues_on_the_kernels(monkeypatch, tmp_path):
    ours, ref, a, b, init = _pair(monkeypatch, SHAPES[:3], steps=2)
    torch.save(ours.state_dict(), tmp_path / "opt.pt")
    other = Adafactor(a, lr=1e-2, weight_decay=0.1)
    other.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for p, q in zip(a, b, strict=True):
        g = torch.randn(p.shape)
        p.grad, q.grad = g.clone(), g.clone()
    other.step()
    ref.step()
    _assert_close(other, ref, a, b, init)
    assert float(other.state[a[0]]["step"]) == 3.0


def test_an_lr_scheduler_reaches_the_kernels(monkeypatch):
    """A scheduler changes the group's lr every step: the fused launches read the new value (the
    step size min(lr, 1/sqrt(t)) and the decay), as the PyTorch path does."""
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES[:3]]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    ours, ref = Adafactor(a, lr=1e-2, weight_decay=0.1), ReferenceAdafactor(b, lr=1e-2, weight_decay=0.1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (ours, ref)]
    for _ in range(4):
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for s in schedules:
            s.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    _assert_close(ours, ref, a, b, init)
