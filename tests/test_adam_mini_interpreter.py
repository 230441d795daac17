"""The Triton Adam-mini kernel (single-tensor variant) under TRITON_INTERPRET=1 vs the reference."""

from __future__ import annotations

import copy

import pytest
import torch
from mini_models import GEOMETRY, fresh_grads, gqa_model
from tolerances import drift_tol, sum_ulps

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers import AdamMini, ReferenceAdamMini
from kernel_factory.optimizers.adam_mini.plan import AdamMiniTritonPlan
from kernel_factory.optimizers.parity import compare_tensors
from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
# fp32 rounding only: an ulp per step, plus the block means' sums in another order (heads of up
# to 16 x 32 elements, rows of up to 896); at most 3 steps.
FP32_TOL = drift_tol(3, ulps_per_step=1 + sum_ulps(896))


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")


def test_kernel_matches_the_reference_with_fp32_momentum():
    # Every item kind and path: rows that fit one 256-wide tile (one pass over memory), rows of
    # 600 that take three tiles (two passes), rows of 384 = 256 + 128 and 896 = 512 + 256 + 128
    # columns (the one-pass launches of whole rows: 2 rows per program, the last one partial, and
    # three tiles), Q/K head blocks of 16 rows and norms (one block each), and a bias (plain Adam).
    a = gqa_model(head_dim=16)
    for name, shape in (("wide", (3, 600)), ("two_tiles", (5, 384)), ("three_tiles", (3, 896))):
        a.names.append(f"layers.0.mlp.{name}.weight")
        a.params.append(torch.nn.Parameter(torch.randn(shape) * 0.02))
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", head_dim=16, **GEOMETRY)
    ours, ref = AdamMini(a.named(), **kw), ReferenceAdamMini(b.named(), **kw)
    for step in range(3):
        fresh_grads(a, b)
        ours.step()
        if step == 0:
            plans = [pl for _, pls, _ in ours._plans.values() for pl in pls]
            assert plans and all(isinstance(pl, AdamMiniTritonPlan) for pl in plans)
            for pl in plans:
                pl.configure(dict(ROWS=2, COLS=256, num_warps=1, num_stages=1))
            shapes = {(rows, widths) for (_, _, rows, widths), _ in plans[0]._launches}
            assert {(2, (0, 0, 0)), (2, (256, 128, 0)), (1, (512, 256, 128))} <= shapes, shapes
        ref.step()
    for (name, p), (_, q) in zip(a.named(), b.named(), strict=True):
        assert compare_tensors(name, "param", p, q, FP32_TOL).passed, name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            row = compare_tensors(name, key, ours.state[p][key], ref.state[q][key], FP32_TOL)
            assert row.passed, row
    s_ours, s_ref = ours.telemetry.summary(), ref.telemetry.summary()
    assert s_ours["amax_update"] == pytest.approx(s_ref["amax_update"], rel=1e-5) and s_ours["amax_update"] > 0


def test_whole_row_launches_take_head_blocks_too():
    # dim 128, two heads of 64 rows: Q/K head blocks of 128-column rows run in the whole-row
    # launch (two passes over 2-row groups), beside per-row tensors of 128 and 384 = 256 + 128 columns.
    shapes = llama_param_shapes(dim=128, layers=1, ffn=384, vocab=8, n_heads=2, n_kv_heads=1)
    a = ShapeModel(shapes)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", dim=128, n_heads=2, n_kv_heads=1)
    ours, ref = AdamMini(a.named(), **kw), ReferenceAdamMini(b.named(), **kw)
    for pl in (pl for _, pls, _ in ours._plans.values() for pl in pls):
        pl.configure(dict(ROWS=2, COLS=256, num_warps=1, num_stages=1))
        kinds = {(widths, int(it[4])) for (_, _, _, widths), items in pl._launches for it in items}
        assert {((128, 0, 0), 1), ((128, 0, 0), 0), ((256, 128, 0), 0)} <= kinds, kinds
    for _ in range(2):
        fresh_grads(a, b)
        ours.step()
        ref.step()
    for (name, p), (_, q) in zip(a.named(), b.named(), strict=True):
        assert compare_tensors(name, "param", p, q, FP32_TOL).passed, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert compare_tensors(name, key, ours.state[p][key], ref.state[q][key], FP32_TOL).passed, (name, key)


def test_plans_built_before_torch_adds_their_groups_step_as_the_step_s_own(monkeypatch):
    # precompile.plan_group from add_param_group (the kernels compile while torch.optim's first
    # add_param_group imports torch._dynamo): the plans built then are the ones the steps take,
    # and they step bitwise as plans the first step builds
    from kernel_factory.optimizers.shared import precompile

    a = gqa_model(head_dim=16)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", head_dim=16, **GEOMETRY)
    late = AdamMini(b.named(), **kw)
    assert not late._plans  # (no background compiles here: plans wait for the step)
    monkeypatch.setattr(precompile, "worth_planning", lambda params: True)
    early = AdamMini(a.named(), **kw)
    built = {index: [pl for pl in plans] for index, (_, plans, _) in early._plans.items()}
    assert built and all(isinstance(pl, AdamMiniTritonPlan) for plans in built.values() for pl in plans)
    for _ in range(2):
        fresh_grads(a, b)
        early.step()
        late.step()
    assert {index: plans for index, (_, plans, _) in early._plans.items()} == built  # the same objects
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(early.state[p][k], late.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
