"""GPU tier for Adafactor: the fused kernels against the PyTorch path on CUDA (fp32 and bf16
params, 8-bit and fp32 statistics), CUDA-graph capture, no host sync with GradScaler's tensors,
and CUDA steps against CPU steps."""

from __future__ import annotations

import pytest
import torch
from cuda_steps import assert_graph_replays_eager, assert_steps_without_host_sync

from kernel_factory.optimizers.adafactor import Adafactor, ReferenceAdafactor
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.gpu
# The kernels add g², u² and p² in another order than torch's norms and use the GPU's approximate
# rsqrt: a few fp32 ulps a step in every update, and now and then a moved stochastic rounding of a
# statistic (one code step, 4.4%, of one row or column in thousands).
UPDATE_TOL = 1e-4
CODE_FLIPS = 1e-3
SHAPES = [(1000, 768), (768, 2048), (130, 300), (8192,), (768,)]


def _pair(shapes, dtype, steps=5, **kw):
    """Params stepped by the kernels in ``dtype`` and by the PyTorch path in fp32 on the same values."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [(torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype) for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.float()) for t in init]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "eps": (1e-30, 1e-3), **kw}
    ours, ref = Adafactor(a, **kw), ReferenceAdafactor(b, **kw)
    for _ in range(steps):
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            p.grad, q.grad = g.clone(), g.float()
        ours.step()
        ref.step()
    return ours, ref, a, b, init


@pytest.mark.parametrize("state_bits", [8, 32])
def test_fp32_kernels_follow_the_pytorch_path(state_bits):
    ours, ref, a, b, init = _pair(SHAPES, torch.float32, state_bits=state_bits)
    (plan,) = ours._plans.values()
    assert not plan.reference and len(plan.launches) == 1
    for i, (p, q, p0) in enumerate(zip(a, b, init, strict=True)):
        row = compare_tensors(f"p{i}", "update", (p - p0).detach(), (q - p0).detach(), UPDATE_TOL)
        assert row.passed, row
        for key, t in ours.state[p].items():
            r = ref.state[q][key]
            assert t.dtype == r.dtype and t.shape == r.shape, key
            if t.dtype in (torch.uint8, torch.int16):
                assert (t != r).float().mean() <= CODE_FLIPS, (i, key)
    assert ours.telemetry.summary()["amax_update"] == pytest.approx(ref.telemetry.summary()["amax_update"], rel=1e-3)


def test_a_bf16_first_moment_follows_the_pytorch_path():
    ours, ref, a, b, init = _pair(SHAPES, torch.float32, beta1=0.9)
    (plan,) = ours._plans.values()
    assert plan.launches[0].variant["momentum"] == "bfloat16"
    for i, (p, q, p0) in enumerate(zip(a, b, init, strict=True)):
        row = compare_tensors(f"p{i}", "update", (p - p0).detach(), (q - p0).detach(), UPDATE_TOL)
        assert row.passed, row
        m, r = ours.state[p]["exp_avg"], ref.state[q]["exp_avg"]
        assert m.dtype == torch.bfloat16 and compare_tensors(f"p{i}", "exp_avg", m.float(), r.float(), 1e-2).passed


def test_an_int8_first_moment_follows_the_pytorch_path():
    """Codes as log_codes.encode_linear makes them but where an ulp of m straddles a rounding (a
    code moved by one, 1/127 of its block's largest value, moves p with it: UPDATE_TOL x 10)."""
    ours, ref, a, b, init = _pair(SHAPES, torch.float32, beta1=0.9, momentum_dtype="int8")
    (plan,) = ours._plans.values()
    assert plan.launches[0].variant["momentum"] == "int8"
    for i, (p, q, p0) in enumerate(zip(a, b, init, strict=True)):
        row = compare_tensors(f"p{i}", "update", (p - p0).detach(), (q - p0).detach(), 10 * UPDATE_TOL)
        assert row.passed, row
        s, r = ours.state[p], ref.state[q]
        assert (s["exp_avg_codes"] != r["exp_avg_codes"]).float().mean() <= CODE_FLIPS, i
        assert compare_tensors(f"p{i}", "scale", s["exp_avg_scale"].float(), r["exp_avg_scale"].float(), 1e-2).passed


def test_an_int8_first_moment_decayed_under_zero_gradients_stays_finite():
    """m decays by beta1 a step where the gradient stays zero (an embedding row of a token the data
    lacks): past some 800 steps a block's bf16 scale amax / 127 is subnormal, its inverse infinite."""
    ours, ref, a, b, init = _pair([(64, 256)], torch.float32, steps=1, beta1=0.9, momentum_dtype="int8")
    for _ in range(1000):
        for p, q in zip(a, b, strict=True):
            p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
        ours.step()
        ref.step()
    (p,), (q,), (p0,) = a, b, init
    assert p.isfinite().all() and ours.state[p]["exp_avg_scale"].float().isfinite().all()
    row = compare_tensors("p", "update", (p - p0).detach(), (q - p0).detach(), 10 * UPDATE_TOL)
    assert row.passed, row


def test_bf16_params_are_the_fp32_arithmetic_rounded_once():
    """One step: each bf16 param within half a bf16 ulp (2^-8 of its value at most: 8 significant
    bits) of the PyTorch path's fp32 result on the same values, plus the fp32 tolerance of the update."""
    ours, ref, a, b, init = _pair(SHAPES, torch.bfloat16, steps=1)
    for p, q, p0 in zip(a, b, init, strict=True):
        p, q = p.detach().float(), q.detach()
        slack = 2**-8 * q.abs() + UPDATE_TOL * (q - p0.float()).abs().max()
        assert bool(((p - q).abs() <= slack).all())


def test_a_captured_step_replays_the_eager_steps_bit_for_bit():
    graphed = assert_graph_replays_eager(lambda ps: Adafactor(ps, lr=1e-2), [(512, 768), (768,), (6000,)])
    s = graphed.telemetry.summary()
    assert s["steps"] == 4 and s["amax_update"] > 0


def test_no_host_sync_with_grad_scaler_tensors():
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((256, 512), (5000,))]
    opt = Adafactor(params, lr=1e-2)
    assert_steps_without_host_sync(opt, params)
    assert opt.telemetry.summary()["skipped_steps"] == 1
    assert float(opt.state[params[0]]["step"]) == 2.0


@pytest.mark.parametrize("state_bits", [8, 32])
def test_cuda_steps_follow_the_cpu_steps(state_bits):
    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(256, 384)), torch.nn.Parameter(torch.randn(5000))]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opts = [Adafactor(ps, lr=1e-2, state_bits=state_bits) for ps in (cpu, gpu)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for c, g in zip(cpu, gpu, strict=True):
            grad = torch.randn(c.shape, generator=gen)
            c.grad, g.grad = grad, grad.cuda()
        for opt in opts:
            opt.step()
    for c, g in zip(cpu, gpu, strict=True):
        assert compare_tensors("p", "x", g.detach().cpu(), c.detach(), 1e-5).passed
