"""GPU tier for TurboAdam: the fused kernels against the PyTorch reference on CUDA, CUDA-graph
capture, no host sync with GradScaler's tensors, exact tensors bitwise our AdamW, and FSDP2 (two
ranks on one GPU over Gloo, the reference path)."""

from __future__ import annotations

import pytest
import torch
from cuda_steps import assert_graph_replays_eager, assert_steps_without_host_sync
from distributed import run_ranks
from fsdp_probe import turbo_adam_equal_to_one_process

from kernel_factory.optimizers import AdamW, TurboAdam
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.gpu
# The kernels use the GPU's approximate sqrt, division, log2 and exp2 where the reference uses
# torch's correctly rounded ones: a few ulps of fp32 per step, and a stochastic rounding of v moves
# where such an ulp straddles its threshold (about one element in a million a step). One moved code
# changes that element's update by 2^(1/6) - 1 = 12%: a few such elements in 2.3 million keep the
# normwise error near 2e-4.
UPDATE_TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
# Decoded moments: an ulp of difference in m (a fused or unfused lerp) can move a block's bf16 scale
# by one bf16 step (0.8%) and its codes with it, and a moved v code changes an element by 12%: a
# few such blocks and elements among thousands keep the normwise error under 1e-2.
STATE_TOL = 1e-2


def _kernel_and_reference(monkeypatch, shapes, dtype, steps=5, **kw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    kw = {"lr": 1e-2, "weight_decay": 0.1, **kw}
    ours, ref = TurboAdam(a, **kw), TurboAdam(b, **kw)
    for _ in range(steps):
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "auto")
        ours.step()
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "torch")
        ref.step()
    return ours, ref, a, b, init


def _assert_decoded_moments_close(ours, ref, p, q, i):
    mine, theirs = ours.decoded_state(p), ref.decoded_state(q)
    for key in ("exp_avg", "exp_avg_sq"):
        row = compare_tensors(f"p{i}", key, mine[key], theirs[key], STATE_TOL)
        assert row.passed, row


def test_a_decoded_block_keeps_its_scale_on_cuda():
    """amax = 7 scale (m / sqrt(v) of a block whose largest is on its lattice) encodes to the same
    scale: the reference divides exactly on CUDA too, and the kernels' 1/7 is rounded down."""
    from kernel_factory.optimizers.turbo_adam import codecs

    scale = torch.tensor([0.046875, 0.0546875, 3.0, 1.5e-3], device="cuda").to(torch.bfloat16).float()
    m = torch.zeros(4, 128, device="cuda")
    m[:, 5] = 7 * scale  # exact in fp32: 8 + 3 significant bits
    _, got = codecs.encode_m(m, torch.ones_like(m), 128, torch.full_like(m, 0.5))
    assert torch.equal(got.float().flatten(), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_bits", [2, 4, 8])
def test_fused_kernels_follow_the_reference(monkeypatch, v_bits, dtype):
    shapes = [(1000, 768), (768, 2048), (130, 300), (8192,), (768,)]
    ours, ref, a, b, init = _kernel_and_reference(monkeypatch, shapes, dtype, v_bits=v_bits)
    (plan,) = ours._plans.values()
    assert not plan.reference and not plan.exact and len(plan.launches) == (2 if v_bits == 2 else 1)
    for i, (p, q, p0) in enumerate(zip(a, b, init, strict=True)):
        row = compare_tensors(f"p{i}", "update", (p - p0).float(), (q - p0).float(), UPDATE_TOL[dtype])
        assert row.passed, row
        assert {k: (t.dtype, t.shape) for k, t in ours.state[p].items()} == \
            {k: (t.dtype, t.shape) for k, t in ref.state[q].items()}
        _assert_decoded_moments_close(ours, ref, p, q, i)
    assert ours.telemetry.summary()["amax_update"] == pytest.approx(ref.telemetry.summary()["amax_update"], rel=1e-3)


def test_moments_decayed_under_zero_gradients_stay_finite_and_follow_the_reference(monkeypatch):
    """A tensor whose gradient stays zero after one step (an embedding row of a token the data
    lacks): m decays by beta1 a step and v by beta2, so m / sqrt(v) passes, after some 800 steps,
    the range where a block's bf16 scale is subnormal and its inverse overflows fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = torch.randn(64, 256, device="cuda", generator=gen)
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ours, ref = TurboAdam([a], lr=1e-2), TurboAdam([b], lr=1e-2)
    g = torch.randn(64, 256, device="cuda", generator=gen)
    g[:, ::3] = 0.0
    for step in range(1001):
        a.grad, b.grad = (g.clone(), g.clone()) if step == 0 else (torch.zeros_like(g), torch.zeros_like(g))
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "auto")
        ours.step()
        monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "torch")
        ref.step()
    assert a.isfinite().all() and all(t.isfinite().all() for t in ours.decoded_state(a).values())
    row = compare_tensors("p", "update", (a - init).detach(), (b - init).detach(), UPDATE_TOL[torch.float32])
    assert row.passed, row


def test_exact_tensors_in_the_fused_launch_are_bitwise_our_adamw():
    torch.manual_seed(0)
    big, small = torch.randn(512, 512, device="cuda"), torch.randn(7, 300, device="cuda")
    a = [torch.nn.Parameter(big.clone()), torch.nn.Parameter(small.clone())]
    b = torch.nn.Parameter(small.clone())
    ours = TurboAdam(a, lr=1e-2, weight_decay=0.1)
    adamw = AdamW([b], lr=1e-2, weight_decay=0.1, state_dtype="fp32")
    for _ in range(4):
        g = torch.randn(7, 300, device="cuda")
        a[0].grad, a[1].grad, b.grad = torch.randn(512, 512, device="cuda"), g.clone(), g.clone()
        ours.step()
        adamw.step()
    (plan,) = ours._plans.values()
    assert not plan.exact and plan.launches[0].variant["exact_items"]
    assert torch.equal(a[1], b)
    assert torch.equal(ours.state[a[1]]["exp_avg_sq"], adamw.state[b]["exp_avg_sq"])


def test_a_captured_step_replays_the_eager_steps_bit_for_bit():
    graphed = assert_graph_replays_eager(lambda ps: TurboAdam(ps, lr=1e-2), [(512, 768), (768,), (6000,)])
    s = graphed.telemetry.summary()
    assert s["steps"] == 4 and s["amax_update"] > 0


def test_no_host_sync_with_grad_scaler_tensors():
    w = torch.nn.Parameter(torch.randn(256, 512, device="cuda"))
    opt = TurboAdam([w], lr=1e-2)
    assert_steps_without_host_sync(opt, [w])
    assert opt.telemetry.summary()["skipped_steps"] == 1


@pytest.mark.parametrize("v_bits", [2, 4, 8])
def test_cuda_steps_follow_the_cpu_steps(v_bits):
    """The fused kernels on CUDA against the reference on the CPU: the codecs' integer parts (hash,
    packing) are exact on both devices; log, exp, sqrt and division differ by ulps, which moves a
    stochastic rounding only when its uniform falls within them of the threshold (a few elements
    in a million a step, for v and for m). A moved m code can move its block's scale at the next
    step, and with it the rounding of the block's 128 codes: after 5 steps the updates agree
    normwise within 1e-3 (UPDATE_TOL) and all but at most 1% of the params (a few blocks of the
    768) within 1e-5 of the CPU's."""
    torch.manual_seed(0)
    cpu = torch.nn.Parameter(torch.randn(256, 384))
    gpu = torch.nn.Parameter(cpu.detach().cuda())
    p0 = cpu.detach().clone()
    opts = [TurboAdam([p], lr=1e-2, v_bits=v_bits, rounding_seed=3) for p in (cpu, gpu)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(256, 384, generator=gen)
        cpu.grad, gpu.grad = g, g.cuda()
        for opt in opts:
            opt.step()
    got, want = gpu.detach().cpu(), cpu.detach()
    assert compare_tensors("p", "update", got - p0, want - p0, UPDATE_TOL[torch.float32]).passed
    moved = (got - want).abs() > 1e-5 * (1 + want.abs())
    assert float(moved.float().mean()) <= 1e-2, int(moved.sum())
    assert {k: t.dtype for k, t in opts[1].state[gpu].items()} == {k: t.dtype for k, t in opts[0].state[cpu].items()}


def test_turbo_adam_under_fsdp2_on_the_gpu_is_within_1e6_of_one_process():
    run_ranks(2, turbo_adam_equal_to_one_process, 1e-6, "cuda")
