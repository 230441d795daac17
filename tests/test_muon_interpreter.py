"""CPU tier, Triton backend: Muon's momentum, normalize and update kernels (single-tensor variant)
under TRITON_INTERPRET=1, NS through torch's matmuls, against torch.optim.Muon and our torch path."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import drift_tol

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers import Muon
from kernel_factory.optimizers.muon.newton_schulz import coefficient_schedule, iterate
from kernel_factory.optimizers.muon.plan import TritonBatch
from kernel_factory.optimizers.parity import compare_tensors
from kernel_factory.optimizers.parity.bounds import muon_tol

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")

# The momentum kernel writes NS's bf16 input and norm, another kernel than torch's ops, so a bf16
# rounding may flip against torch's: params within bounds.muon_tol (NS's bf16 bound times how far
# 10 steps move them). The momentum buffers follow torch's lerp formula in fp32: an ulp per step
# over 10 steps. One step of fp16 params rounds as the expected values do.
BUF_TOL, FP16_STEP_TOL = drift_tol(10), 1e-6
# Square, tall and wide, sharing NS batches; 80 x 40 and 40 x 80 span several 64 x 64 tiles with
# ragged edges; a conv weight is flattened to (16, 4 * 3 * 3).
SHAPES = [(32, 32), (32, 32), (80, 40), (40, 80), (40, 80), (16, 4, 3, 3), (36, 16)]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in SHAPES]


def _run(opt, params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _batches(opt):
    return [b for plan in opt._plans.values() for b in plan.batches]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_kernels_match_torch_muon_over_10_steps(triton_backend, nesterov, adjust_lr_fn):
    ours_p, torch_p = _params(), _params()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    torch_views = [p.view(p.shape[0], -1) for p in torch_p]  # torch.optim.Muon takes 2-D params only
    ours, theirs = Muon(ours_p, **kw), torch.optim.Muon(torch_views, **kw)
    _run(ours, ours_p, 10)
    _run(theirs, torch_views, 10)
    batches = _batches(ours)
    assert batches and all(isinstance(b, TritonBatch) and not b.multi_tensor for b in batches)
    assert sorted((b.m, b.n, len(b.params)) for b in batches) == [(16, 36, 2), (32, 32, 2), (40, 80, 3)]
    tol = muon_tol(SHAPES, kw["lr"], steps=10, init_std=0.1, adjust_lr_fn=adjust_lr_fn)
    for i, (a, b) in enumerate(zip(ours_p, torch_p, strict=True)):
        assert compare_tensors(f"p{i}", "param", a, b, tol).passed
        buf_a = ours.state[a]["momentum_buffer"]
        buf_b = theirs.state[torch_views[i]]["momentum_buffer"]
        assert compare_tensors(f"p{i}", "momentum_buffer", buf_a.view(buf_b.shape), buf_b, BUF_TOL).passed


def test_fp16_params_round_where_torch_on_cuda_rounds(triton_backend):
    # torch's CUDA kernels compute fp16 in fp32 and round each stored tensor to fp16 (its CPU lerp
    # rounds differently, so the oracle is that arithmetic written out): buf and u are fp16, X is
    # bf16(u) / bf16 norm, p is rounded after the decay and after the update.
    (p,) = _params(torch.float16)[2:3]
    start = p.clone()
    opt = Muon([p], lr=0.02, weight_decay=0.1, momentum=0.9)
    g = torch.randn(p.shape).half()
    p.grad = g
    opt.step()
    buf = (0.1 * g.float()).half()  # lerp(0, g, 0.1) = 0 + 0.1 (g - 0)
    assert torch.equal(opt.state[p]["momentum_buffer"], buf)
    u = (buf.float() - (buf.float() - g.float()) * (1 - 0.9)).half()  # lerp(g, buf, 0.9), weight >= 0.5
    x = u.T.bfloat16()  # a tall matrix is orthogonalized transposed
    o = iterate(x / torch.linalg.vector_norm(x).clamp(min=1e-7), coefficient_schedule(None, 5)).T
    decayed = (start.float() * (1 - 0.02 * 0.1)).half().float()
    expected = (decayed - 0.02 * math.sqrt(80 / 40) * o.half().float()).half()
    assert compare_tensors("p", "param", p, expected, FP16_STEP_TOL).passed


def test_a_checkpointed_view_buffer_is_made_contiguous(triton_backend):
    p = _params()[2]
    opt = Muon([p], lr=0.02)
    _run(opt, [p], 1)
    state = opt.state_dict()
    state["state"][0]["momentum_buffer"] = state["state"][0]["momentum_buffer"].T.contiguous().T  # a view
    q = p.detach().clone()
    opt_q = Muon([q], lr=0.02)
    opt_q.load_state_dict(state)
    _run(opt, [p], 2, seed=5)
    _run(opt_q, [q], 2, seed=5)
    assert opt_q.state[q]["momentum_buffer"].is_contiguous()
    assert torch.equal(p, q)


def test_plans_built_before_torch_adds_their_groups_step_as_the_step_s_own(triton_backend, monkeypatch):
    # precompile.plan_group from add_param_group (the kernels compile while torch.optim's first
    # add_param_group imports torch._dynamo): the plans built then, with their groups' state, are
    # the ones the steps take, and they step bitwise as plans the first step builds
    from kernel_factory.optimizers.shared import precompile

    bias = torch.randn(8) * 0.1  # AdamW's
    early_p, late_p = ([p.requires_grad_() for p in _params() + [bias.clone()]] for _ in range(2))
    late = Muon(late_p, lr=0.02, weight_decay=0.1)
    assert not late._plans  # (no background compiles here: plans wait for the step)
    monkeypatch.setattr(precompile, "worth_planning", lambda params: True)
    early = Muon(early_p, lr=0.02, weight_decay=0.1)
    built = dict(early._plans)
    assert set(built) == {0, 1} and built[0].batches and all(isinstance(b, TritonBatch) for b in built[0].batches)
    _run(early, early_p, 3)
    _run(late, late_p, 3)
    assert all(early._plans[i] is built[i] for i in built)  # the same objects
    for p, q in zip(early_p, late_p, strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(early.state[p][k], late.state[q][k]) for k in early.state[p])
