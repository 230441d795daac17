"""Newton–Schulz and Muon on CPU: against torch.optim.Muon's own NS and optimizer."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from tolerances import drift_tol
from torch.optim._muon import _zeropower_via_newtonschulz

from kernel_factory.optimizers import Muon, fast_newton_schulz
from kernel_factory.optimizers.muon.newton_schulz import NS5_COEFFICIENTS, coefficient_schedule, reference_newton_schulz
from kernel_factory.optimizers.parity import compare_tensors

# NS runs in bf16: results agree to bf16's 8 bits (2^-8 ~ 4e-3 per element); 2e-2 normwise.
NS_TOL = 2e-2
# Muon: params move by lr * O with O in bf16; 1e-3 normwise over 10 steps (the bound).
MUON_TOL = 1e-3


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 48), (4, 40, 72), (3, 72, 40), (1, 1, 7)])
def test_fast_newton_schulz_matches_the_reference(shape):
    G = torch.randn(shape)
    out = fast_newton_schulz(G)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    ref = reference_newton_schulz(G)
    assert compare_tensors("ns", "O", out, ref, NS_TOL).passed
    if G.dim() == 2:  # and the reference is torch.optim.Muon's own
        torch_ns = _zeropower_via_newtonschulz(G, NS5_COEFFICIENTS, 5, 1e-7)
        assert compare_tensors("ns", "O", ref, torch_ns, NS_TOL).passed


def test_ns_orthogonalizes_and_polar_express_gets_closer_to_the_polar_factor():
    # A batch of 8: on one 96 x 64 matrix the error ratio below ranged 0.41-0.53 over 300 draws
    # (above 0.5 in 4%); over 8 at once it ranged 0.45-0.49 over 200.
    G = torch.randn(8, 96, 64)
    u, _, vh = torch.linalg.svd(G, full_matrices=False)
    polar = u @ vh
    errors = {}
    for coefficients in (None, "polar_express"):
        out = fast_newton_schulz(G, coefficients=coefficients).float()
        assert compare_tensors("ns", "O", out, reference_newton_schulz(G, coefficients=coefficients), NS_TOL).passed
        s = torch.linalg.svdvals(out)
        assert 0.5 < float(s.min()) and float(s.max()) < 1.5  # NS5's S' lies in about (0.5, 1.5)
        errors[coefficients] = float((out - polar).norm() / polar.norm())
    assert errors["polar_express"] < 0.5 * errors[None]


def test_coefficient_schedules_and_bad_input():
    assert coefficient_schedule(None, 2) == [NS5_COEFFICIENTS] * 2
    two = [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]
    assert coefficient_schedule(two, 3) == [two[0], two[1], two[1]]
    assert len(coefficient_schedule("polar_express", 5)) == 5
    with pytest.raises(ValueError, match="coefficients"):
        coefficient_schedule("quartic", 5)
    with pytest.raises(ValueError, match="3 floats"):
        coefficient_schedule((1.0, 2.0), 5)
    with pytest.raises(ValueError, match="steps"):
        coefficient_schedule(None, 100)
    with pytest.raises(ValueError, match="shape"):
        fast_newton_schulz(torch.randn(4))
    with pytest.raises(TypeError, match="floating"):
        fast_newton_schulz(torch.ones(4, 4, dtype=torch.int32))


def test_a_steps_hyperparameters_are_the_groups_and_bad_values_fail_every_step():
    # MuonHyper memoizes the schedule and eps in bf16 by value: a value equal to a cached one under
    # == (True == 1, 1 == 1.0) is still checked as itself.
    from kernel_factory.optimizers.muon.plan import MuonHyper

    group = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None, eps=1e-7,
                 ns_coefficients=[[1, 2.0, 3.0], (4.0, 5.0, 6.0)], ns_steps=3)  # fmt: skip
    for _ in range(2):
        h = MuonHyper(group)
        assert h.schedule == coefficient_schedule(group["ns_coefficients"], 3)
        assert h.eps_bf16 == float(torch.tensor(1e-7, dtype=torch.bfloat16))
    h.schedule.append(None)  # the caller's copy
    assert MuonHyper(group).schedule == coefficient_schedule(group["ns_coefficients"], 3)
    for key, good, bad, match in [("ns_steps", 1, True, "steps"),
                                  ("ns_coefficients", [[1, 2.0, 3.0]], [[True, 2.0, 3.0]], "3 floats")]:  # fmt: skip
        MuonHyper({**group, key: good})  # memoized
        with pytest.raises(ValueError, match=match):
            MuonHyper({**group, key: bad})


def _matrices(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(32, 32), (32, 32), (32, 32), (64, 32), (64, 32), (32, 96), (96, 32)]  # batched, tall, wide
    return [torch.randn(s, generator=gen) * 0.1 for s in shapes]


def _run(opt, params, steps: int, seed: int = 1, sched=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_matches_torch_muon_over_10_steps(nesterov, adjust_lr_fn):
    ours_p, torch_p = _matrices(), _matrices()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    _run(Muon(ours_p, **kw), ours_p, 10)
    _run(torch.optim.Muon(torch_p, **kw), torch_p, 10)
    for i, (a, b) in enumerate(zip(ours_p, torch_p, strict=True)):
        assert compare_tensors(f"p{i}", "param", a, b, MUON_TOL).passed


def test_non_matrix_params_take_adamw_with_their_own_hyperparameters():
    def model():
        gen = torch.Generator().manual_seed(3)
        shapes = [("embed_tokens.weight", (50, 32)), ("layers.0.mlp.weight", (64, 32)), ("layers.0.norm.weight", (32,)),
                  ("layers.0.mlp.bias", (64,)), ("lm_head.weight", (50, 32))]  # fmt: skip
        return [(n, torch.randn(s, generator=gen)) for n, s in shapes]

    named = model()
    opt = Muon(named, lr=0.02, adamw_lr=1e-3, adamw_betas=(0.8, 0.9), adamw_weight_decay=0.05)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [p.shape for p in opt.param_groups[0]["params"]] == [(64, 32)]
    twin = model()
    adamw_params = [p for n, p in twin if n != "layers.0.mlp.weight"]
    ref = torch.optim.AdamW(adamw_params, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.05)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        for (_, p), (_, q) in zip(named, twin, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for (n, p), (_, q) in zip(named, twin, strict=True):
        if n != "layers.0.mlp.weight":
            # torch's fused CPU kernel (ours on CPU) against its for-loop path: an ulp per step
            assert compare_tensors(n, "param", p, q, drift_tol(5)).passed


@pytest.mark.parametrize("out_channels", [16, 64])  # wide (16 x 36) and tall (64 x 36) once flattened
def test_conv_weights_are_flattened_rows_by_the_rest(out_channels):
    conv = torch.randn(out_channels, 4, 3, 3) * 0.1
    flat = conv.detach().clone().view(out_channels, 36)
    _run(Muon([conv], lr=0.02), [conv], 3)
    _run(torch.optim.Muon([flat], lr=0.02), [flat], 3)
    assert compare_tensors("conv", "param", conv.view(out_channels, 36), flat, MUON_TOL).passed


def test_state_dict_round_trip_and_lr_scheduler():
    def build(params):
        opt = Muon([("w", params[0]), ("b", params[1])], lr=0.02, adamw_lr=1e-3)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    a = [torch.randn(32, 16), torch.randn(16)]
    opt_a, sched_a = build(a)
    _run(opt_a, a, 3, sched=sched_a)
    assert [g["lr"] for g in opt_a.param_groups] == [0.01, 0.0005]  # both groups follow the schedule
    buffer = io.BytesIO()
    torch.save({"opt": opt_a.state_dict(), "sched": sched_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    b = [t.detach().clone() for t in a]
    opt_b, sched_b = build(b)
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])
    _run(opt_a, a, 3, seed=7, sched=sched_a)
    _run(opt_b, b, 3, seed=7, sched=sched_b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert set(opt_b.state[b[0]]) == {"momentum_buffer"} and "exp_avg" in opt_b.state[b[1]]


def test_add_param_group_splits_a_group_as_the_constructor_does():
    """A new group's matrices go to Muon and its vectors to AdamW with the group's adamw_* values (as
    the constructor would split it), use_muon overrides with the constructor's error, and a copy of
    the optimizer keeps the AdamW defaults it splits with."""
    w, b = torch.randn(32, 16), torch.randn(32)
    opt = Muon([torch.randn(16, 16)], lr=0.02, adamw_lr=1e-3, adamw_betas=(0.8, 0.9))
    opt.add_param_group({"params": [w, b], "lr": 0.01, "adamw_weight_decay": 0.05})
    added = opt.param_groups[1:]
    assert [(g["use_muon"], g["lr"]) for g in added] == [(True, 0.01), (False, 1e-3)]
    assert added[0]["params"][0] is w and added[1]["params"][0] is b and added[1]["weight_decay"] == 0.05
    twin = b.clone()
    ref = torch.optim.AdamW([twin], lr=1e-3, betas=(0.8, 0.9), weight_decay=0.05)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p in opt.param_groups[0]["params"] + [w]:
            p.grad = torch.randn(p.shape, generator=gen)
        b.grad = torch.randn(b.shape, generator=gen)
        twin.grad = b.grad.clone()
        opt.step()
        ref.step()
    assert compare_tensors("bias", "param", b, twin, drift_tol(3)).passed  # AdamW's step, not Muon's
    opt.add_param_group({"params": [torch.randn(8)], "use_muon": False})
    assert opt.param_groups[-1]["use_muon"] is False and opt.param_groups[-1]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="ndim >= 2"):
        opt.add_param_group({"params": [torch.randn(8)], "use_muon": True})
    copy = pickle.loads(pickle.dumps(opt))
    copy.add_param_group({"params": [torch.randn(4)]})
    assert copy.param_groups[-1]["use_muon"] is False and copy.param_groups[-1]["lr"] == 1e-3


def test_bad_arguments_name_the_parameter():
    p = [torch.randn(8, 8)]
    with pytest.raises(ValueError, match="momentum"):
        Muon(p, momentum=-0.1)
    with pytest.raises(ValueError, match="Adjust learning rate"):
        Muon(p, adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="steps"):
        Muon(p, ns_steps=100)
    with pytest.raises(ValueError, match="coefficient"):
        Muon(p, ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="ndim >= 2"):
        Muon([{"params": [torch.randn(8)], "use_muon": True}])
    with pytest.raises(ValueError, match="beta"):
        Muon(p, adamw_betas=(0.9, 1.5))
    opt = Muon(p)
    p[0].grad = torch.randn(8, 8).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_same_shape_matrices_and_transposes_are_orthogonalized_in_one_call(monkeypatch):
    import kernel_factory.optimizers.muon.plan as muon_plan

    calls = []
    real = muon_plan.iterate
    monkeypatch.setattr(muon_plan, "iterate", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    params = _matrices()
    _run(Muon(params), params, 1)
    assert sorted(calls) == [(2, 32, 64), (2, 32, 96), (3, 32, 32)]  # tall ones join their transposes


def test_newton_schulz_workloads_each_tune_a_key_of_their_own():
    # ns_config keys the cache by one iteration's FLOPs and the short side: each workload needs a
    # key of its own (by elements, 36 x 768 x 2048 and 8192^2 shared one; by FLOPs alone,
    # 2048 x 8192 and the 134M list's joint batch)
    from kernel_factory.generator import NEWTON_SCHULZ
    from kernel_factory.optimizers.muon.newton_schulz_launch import iteration_flops, side_class
    from kernel_factory.optimizers.muon.newton_schulz_tune import WORKLOADS, workload_key

    keys = [workload_key(shapes) for shapes in WORKLOADS]
    assert len(set(keys)) == len(WORKLOADS) == 8
    assert sorted({bucket for _, bucket in keys}) == sorted(NEWTON_SCHULZ.tune_sizes)
    assert {side for side, _ in keys} == set(NEWTON_SCHULZ.axes["side"])
    assert [side_class(m) for m in (1, 768, 1024, 1025, 2048, 4096, 11008, 16384)] == \
        [1024, 1024, 1024, 2048, 2048, 4096, 8192, 8192]  # fmt: skip
    for shapes in WORKLOADS:  # a joint workload is keyed by its batch with the most work
        assert shapes[0] == max(shapes, key=lambda shape: iteration_flops(*shape))


def test_ns_config_keys_by_short_side_and_work(monkeypatch):
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns

    asked = []
    monkeypatch.setattr(ns, "select", lambda family, arch, variant, dtype, work: asked.append((dict(variant), work))
                        or {})  # fmt: skip
    ns.ns_config(torch.zeros(2048, 8192, dtype=torch.bfloat16))
    ns.ns_config(torch.zeros(36, 768, 2048, dtype=torch.bfloat16))
    assert [v["product"] for v, _ in asked] == ["gram", "poly", "update"] * 2
    # the same FLOP bucket (2^38), told apart by the side
    assert {(v["side"], ns.size_bucket(w)) for v, w in asked} == {(2048, 1 << 38), (1024, 1 << 38)}


def test_sharded_batches_are_cut_into_stages_of_about_equal_ns_work():
    from types import SimpleNamespace

    from kernel_factory.optimizers.muon.distributed import split_in_stages

    def batch(count, m, n):  # count matrices whose NS runs on m x n (m <= n)
        return SimpleNamespace(params=[None] * count, x=torch.empty(0, m, n))

    # Llama-2-7B's four layers: 16 of 4096², 8 of 4096 x 11008 (up, gate), 4 of 4096 x 11008 (down)
    square, up, down = batch(16, 4096, 4096), batch(8, 4096, 11008), batch(4, 4096, 11008)
    assert split_in_stages([square, up, down], 1) == [[square, up, down]]
    assert split_in_stages([square, up, down], 2) == [[square], [up, down]]  # 1.1 : 2.2 beats 2.6 : 0.7
    assert split_in_stages([square, up, down], 5) == [[square], [up], [down]]
    assert split_in_stages([down, square], 2) == [[down], [square]]
    assert split_in_stages([], 2) == []


def test_paired_stages_give_every_launch_two_batches_where_they_can():
    from types import SimpleNamespace

    from kernel_factory.optimizers.muon.distributed import paired_stages, split_in_stages

    def batch(count, m, n):
        return SimpleNamespace(params=[None] * count, x=torch.empty(0, m, n))

    # a 123M GQA model's batches in the order of its params: q and o, k and v, gate and up (NS on
    # their transposes), down; work 10.9, 0.7, 29.0, 14.5 (x 1e9). Cut in runs, the k and v
    # matrices share a stage with two others and take launches of their own; in pairs none does,
    # and of the three cuts in pairs the most even is 25.4 : 29.7
    qo, kv, up, down = batch(24, 768, 768), batch(24, 192, 768), batch(24, 768, 2048), batch(12, 768, 2048)
    assert paired_stages([qo, kv, up, down], 2) == [[qo, down], [kv, up]]
    # the lightest last stage of the three (15.2, beside 29.7 and 43.5): the replies left exposed
    assert paired_stages([qo, kv, up, down], 2, light_last=True) == [[qo, up], [kv, down]]
    # in three: 3 launches however cut; the last stage starts after k/v, so down (14.5) at best
    assert paired_stages([qo, kv, up, down], 3, light_last=True) == [[qo, kv], [up], [down]]
    assert paired_stages([qo, kv, up, down], 1) == [[qo, kv, up, down]]
    assert paired_stages([qo, kv, up, down], 3) == [[qo, kv], [up], [down]]  # 3 launches, 29.0 at most, however cut
    assert paired_stages([qo, up, down], 2) == [[qo, down], [up]]  # 25.4 : 29.0, beside 39.9 or 43.5
    assert paired_stages([qo, kv, up, down], 5) == [[qo], [kv], [up], [down]]
    assert paired_stages([down, qo], 2) == [[down], [qo]]
    assert paired_stages([], 2) == []
    many = [batch(1, 64 * (i + 1), 64 * (i + 1)) for i in range(12)]  # past PAIRED_MAX: cut in runs
    assert paired_stages(many, 2) == split_in_stages(many, 2)


def test_stage_labels_list_every_cut_once():
    from kernel_factory.optimizers.muon.distributed import _stage_labels

    cuts = list(_stage_labels(5, 2))
    assert len(cuts) == len(set(cuts)) == 15  # Stirling S(5, 2)
    assert len(list(_stage_labels(10, 3))) == 9330 and list(_stage_labels(3, 3)) == [(0, 1, 2)]
    assert all(c[0] == 0 and set(c) == {0, 1} for c in cuts)
