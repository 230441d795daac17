"""TurboAdam's fused kernels (single-tensor variant) under TRITON_INTERPRET=1 vs the PyTorch reference.

The kernels follow the reference's arithmetic, so codes, scales and bases come out equal and fp32
values within an ulp or two a step (the row and column sums of g² are added in another order);
a stochastic rounding could flip where that ulp straddles its threshold, which the bound on
differing codes allows for, not more."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers import TurboAdam
from kernel_factory.optimizers.parity import compare_tensors
from kernel_factory.optimizers.turbo_adam.plan import TurboLaunch

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
# fp32: a few ulps a step over 3 steps (sums of up to 384 squares in another order enter v)
FP32_TOL = 2e-6
CODE_FLIPS = 1e-3  # fraction of code bytes a one-ulp difference may move


def _pair(monkeypatch, shapes, steps=3, dtype=torch.float32, **kw):
    """The same params stepped by the kernels and by the reference; returns both optimizers and params."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "rounding_seed": 5, **kw}
    ours, ref = TurboAdam(a, **kw), TurboAdam(b, **kw)
    for step in range(steps):
        grads = [torch.randn(s, generator=gen).to(dtype) * (1 + step) for s in shapes]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
        ours.step()
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "torch")
        ref.step()
    return ours, ref, a, b


def _assert_same_state(ours, ref, a, b, tol=FP32_TOL):
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert compare_tensors(f"p{i}", "param", p.detach(), q.detach(), tol).passed, i
        s, r = ours.state[p], ref.state[q]
        assert s.keys() == r.keys()
        for key in s:
            assert s[key].dtype == r[key].dtype and s[key].shape == r[key].shape, key
            if s[key].dtype == torch.uint8:
                assert (s[key] != r[key]).float().mean() <= CODE_FLIPS, (i, key)
            elif s[key].dtype in (torch.int16, torch.bfloat16):
                assert (s[key] != r[key]).float().mean() <= CODE_FLIPS, (i, key)
            else:
                assert compare_tensors(f"p{i}", key, s[key], r[key], tol).passed, (i, key)


@pytest.mark.parametrize("v_bits", [2, 4, 8])
def test_kernels_follow_the_reference(monkeypatch, v_bits):
    # a matrix whose columns end inside a 128-group and whose rows end inside a tile, one of whole
    # groups, a vector of 4096+ (log codes: one row, many groups), and a small tensor (exact moments)
    shapes = [(10, 300), (8, 384), (5000,), (7, 9)]
    ours, ref, a, b = _pair(monkeypatch, shapes, v_bits=v_bits)
    plans = list(ours._plans.values())
    assert plans and all(not plan.reference and plan.launches for plan in plans)
    _assert_same_state(ours, ref, a, b)
    s_ours, s_ref = ours.telemetry.summary(), ref.telemetry.summary()
    assert s_ours["amax_update"] == pytest.approx(s_ref["amax_update"], rel=1e-5) and s_ours["amax_update"] > 0


@pytest.mark.parametrize("flags", [dict(compress_m=False), dict(compress_v=False)])
def test_v_only_and_m_only_run_the_same_kernels(monkeypatch, flags):
    ours, ref, a, b = _pair(monkeypatch, [(16, 260), (8, 512)], **flags)
    assert all(plan.launches for plan in ours._plans.values())
    _assert_same_state(ours, ref, a, b)


@pytest.mark.parametrize("block", [32, 64, 256])
def test_other_block_sizes(monkeypatch, block):
    ours, ref, a, b = _pair(monkeypatch, [(7, 640)], steps=2, block_size=block)
    assert all(plan.launches for plan in ours._plans.values())
    _assert_same_state(ours, ref, a, b)


def test_fp16_params(monkeypatch):
    ours, ref, a, b = _pair(monkeypatch, [(16, 256)], steps=2, dtype=torch.float16)
    _assert_same_state(ours, ref, a, b, tol=1e-3)  # one fp16 rounding of p a step


def test_grad_scale_in_the_kernel_and_an_inf_skips_the_step(monkeypatch):
    """GradScaler's scale is divided out on the device, and found_inf leaves params and state as they
    were, read by the kernels (no host sync on this path)."""
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    gen = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(16, 256, generator=gen))
    twin = torch.nn.Parameter(w.detach().clone())
    opt, ref = TurboAdam([w], lr=1e-2), TurboAdam([twin], lr=1e-2)
    g = torch.randn(16, 256, generator=gen)
    w.grad, twin.grad = g * 1024, g.clone()
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    opt.step()
    ref.step()
    assert torch.equal(w.detach(), twin.detach())
    before = {k: t.clone() for k, t in opt.state[w].items()}
    p_before = w.detach().clone()
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert torch.equal(w.detach(), p_before)
    assert all(torch.equal(opt.state[w][k], before[k]) for k in before)
    assert opt.telemetry.summary()["skipped_steps"] == 1


@pytest.mark.parametrize("cols", [300, 512])
def test_prefetching_the_next_tile_gives_the_same_bits(monkeypatch, cols):
    """PREFETCH moves the next tile's loads ahead of this tile's stores, nothing else: the same
    params and states to the bit after two steps, with tiles that wrap to the next row of an item and
    past its last (300 columns: a partial last tile; 512: whole ones)."""
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    results = []
    for prefetch in (0, 1):
        w = torch.nn.Parameter(torch.randn(24, cols, generator=torch.Generator().manual_seed(3)))
        opt = TurboAdam([w], lr=1e-2)
        w.grad = torch.randn(24, cols, generator=torch.Generator().manual_seed(4))
        opt.step()
        opt._plans[0].launches[0].configure(dict(ROWS=4, G=2, SPAN=2, BAND=16, num_warps=1, maxnreg=0,
                                                 PREFETCH=prefetch))  # fmt: skip
        for step in range(2):
            w.grad = torch.randn(24, cols, generator=torch.Generator().manual_seed(5 + step))
            opt.step()
        results.append((w.detach().clone(), {k: t.clone() for k, t in opt.state[w].items()}))
    (p0, s0), (p1, s1) = results
    assert torch.equal(p0, p1)
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def test_configs_give_the_same_result(monkeypatch):
    """Tile shape, tiles per program and stats bands change the work split, not the arithmetic
    (but for the order of the column sums over bands)."""
    results = []
    configs = (dict(ROWS=1, G=2, SPAN=1, BAND=16, num_warps=1, maxnreg=0, PREFETCH=0),
               dict(ROWS=4, G=4, SPAN=2, BAND=64, num_warps=2, maxnreg=0, PREFETCH=1))
    for config in configs:
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
        w = torch.nn.Parameter(torch.randn(40, 300, generator=torch.Generator().manual_seed(3)))
        opt = TurboAdam([w], lr=1e-2)
        w.grad = torch.randn(40, 300, generator=torch.Generator().manual_seed(4))
        opt.step()  # builds the plan with the cached config
        launch: TurboLaunch = opt._plans[0].launches[0]
        launch.configure(config)
        for step in range(2):
            w.grad = torch.randn(40, 300, generator=torch.Generator().manual_seed(5 + step))
            opt.step()
        results.append((w.detach().clone(), {k: t.clone() for k, t in opt.state[w].items()}))
    (p0, s0), (p1, s1) = results
    assert compare_tensors("w", "param", p0, p1, FP32_TOL).passed
    for key in s0:
        if s0[key].dtype == torch.uint8:
            assert (s0[key] != s1[key]).float().mean() <= CODE_FLIPS, key


def test_a_row_whose_first_gradient_comes_late_steps_as_adamw_does_on_the_kernels(monkeypatch):
    from test_turbo_adam_cpu import assert_a_late_row_steps_as_adamw_does

    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    assert_a_late_row_steps_as_adamw_does()


@pytest.mark.parametrize("mode", ["default", "v_only", "m_only"])
def test_the_tuners_launch_list_is_the_plans(monkeypatch, mode):
    """tune.launch_codecs (the tuner's keys, known without allocating) names the fused launches a
    step builds: one per layout, largest first (matrices with factored v, a 4096-element vector with
    4-bit ln codes)."""
    from kernel_factory.optimizers.turbo_adam.tune import MODES, launch_codecs

    shapes = [(64, 128), (4096,), (96, 64)]
    ours, _, _, _ = _pair(monkeypatch, shapes, steps=1, **MODES[mode])
    (plan,) = ours._plans.values()
    built = [(ln.variant["m_codec"], ln.variant["v_codec"], sum(p.numel() for p in ln.params[: ln.n_coded]))
             for ln in plan.launches]  # fmt: skip
    assert not plan.reference and built == launch_codecs(shapes, mode)


def test_plans_built_before_torch_adds_their_groups_step_as_the_step_s_own(monkeypatch):
    # precompile.plan_group from add_param_group (the kernels compile while torch.optim's first
    # add_param_group imports torch._dynamo): the plans built then, with their params' state, are
    # the ones the steps take, and they step bitwise as plans the first step builds
    from kernel_factory.optimizers.shared import precompile

    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")
    shapes = [(10, 300), (5000,), (7, 9)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    a, b = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    kw = dict(lr=1e-2, weight_decay=0.1, rounding_seed=5)
    late = TurboAdam([{"params": b[:2]}, {"params": b[2:], "lr": 3e-3}], **kw)
    assert not late._plans  # (no background compiles here: plans wait for the step)
    monkeypatch.setattr(precompile, "worth_planning", lambda params: True)
    early = TurboAdam([{"params": a[:2]}, {"params": a[2:], "lr": 3e-3}], **kw)
    built = dict(early._plans)
    assert set(built) == {0, 1} and built[0].launches
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        early.step()
        late.step()
    assert all(early._plans[i] is built[i] for i in built)  # the same objects
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q) and early.state[p].keys() == late.state[q].keys()
        assert all(torch.equal(early.state[p][k], late.state[q][k]) for k in early.state[p])
