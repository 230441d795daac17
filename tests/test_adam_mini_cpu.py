"""AdamMini on CPU: partition, parity with adam-mini 1.1.1, state_dict, FP8 storage reference."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from mini_models import GEOMETRY, checkpoint_twin, fresh_grads, gqa_model, steps_stay_equal
from tolerances import drift_tol, sum_ulps

from kernel_factory.optimizers import AdamMini, NameRules
from kernel_factory.optimizers.adam_mini.fp8 import (
    FLUSH_BELOW,
    REL_ERROR_BOUND,
    UNDERFLOW_FRACTION,
    dequantize,
    new_fp8_state,
    quantize_,
)
from kernel_factory.optimizers.parity import compare_tensors

# Two implementations of the same math (adam-mini's torch ops and ours): an ulp per step plus the
# block means' sums in another order (the GQA model's largest block: a head of 8 x 32), 10 steps.
TOL = drift_tol(10, ulps_per_step=1 + sum_ulps(8 * 32))


def official(model, lr=1e-2, weight_decay=0.1):
    adam_mini = pytest.importorskip("adam_mini")  # the dev extra installs it; CI runs this
    return adam_mini.Adam_mini(model.named(), lr=lr, weight_decay=weight_decay, verbose=False, **GEOMETRY)


def test_partition_matches_adam_mini_block_counts():
    ours_model, theirs_model = gqa_model(), gqa_model()
    ours = AdamMini(ours_model.named(), lr=1e-2, momentum_dtype="fp32", **GEOMETRY)
    theirs = official(theirs_model)
    fresh_grads(ours_model, theirs_model)
    theirs.step()
    by_name = {n: b for n, _, _, b, _ in ours.partition_table()}
    for name, p in theirs_model.named():
        state = theirs.state[p]
        expected = state["v"].numel() if "v" in state else state["vmean"].numel()
        assert by_name[name] == expected, name
    kinds = {n: k for n, _, k, _, _ in ours.partition_table()}
    assert kinds["layers.0.self_attn.k_proj.weight"] == "head" and by_name["layers.0.self_attn.k_proj.weight"] == 2
    assert kinds["layers.0.self_attn.v_proj.weight"] == "row" and kinds["embed_tokens.weight"] == "row"
    assert kinds["norm.weight"] == "whole" and kinds["layers.1.mlp.down_proj.bias"] == "adam"


def test_fp32_momentum_equals_adam_mini_over_10_steps():
    ours_model = gqa_model()
    theirs_model = copy.deepcopy(ours_model)
    ours = AdamMini(ours_model.named(), lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", **GEOMETRY)
    theirs = official(theirs_model)
    for _ in range(10):
        fresh_grads(ours_model, theirs_model)
        ours.step()
        theirs.step()
    for (name, p), (_, q) in zip(ours_model.named(), theirs_model.named(), strict=True):
        row = compare_tensors(name, "param", p, q, TOL)
        assert row.passed, row
        m = ours.state[p]["exp_avg"]
        assert compare_tensors(name, "exp_avg", m, theirs.state[q]["m"].view(m.shape), TOL).passed


def test_head_dim_other_than_dim_over_heads_and_fused_qkv():
    model = gqa_model(head_dim=16)  # q: 4 heads x 16 rows = 64 rows, k: 2 x 16
    fused = torch.nn.Parameter(torch.randn(4 * 16 + 2 * 2 * 16, 32))
    opt = AdamMini([*model.named(), ("layers.0.attn.qkv.weight", fused)], momentum_dtype="fp32",
                   head_dim=16, **GEOMETRY)  # fmt: skip
    blocks = {n: b for n, _, _, b, _ in opt.partition_table()}
    assert blocks["layers.0.self_attn.q_proj.weight"] == 4 and blocks["layers.0.self_attn.k_proj.weight"] == 2
    assert blocks["layers.0.attn.qkv.weight"] == 4 + 2 + 32  # Q heads, K heads, V rows
    fresh_grads(model)
    fused.grad = torch.randn_like(fused)
    opt.step()
    assert opt.state[fused]["exp_avg_sq"].shape == (38,)
    with pytest.raises(ValueError, match="qkv.weight.*split"):
        AdamMini([("attn.qkv.weight", torch.nn.Parameter(torch.randn(100, 32)))], **GEOMETRY)


def test_unmatched_parameters_are_listed_and_warned_about():
    p = torch.nn.Parameter(torch.randn(6, 5))
    with pytest.warns(RuntimeWarning, match="no name rule matched.*mystery") as record:
        opt = AdamMini([("mystery", p)], momentum_dtype="fp32", **GEOMETRY)
    assert record[0].filename == __file__  # the user's line, not the library's
    assert opt.partition_table() == [("mystery", (6, 5), "whole (unmatched)", 1, "fp32")]
    opt = AdamMini([("mystery", p)], momentum_dtype="fp32", name_rules=NameRules().extended(mlp=("myst",)),
                   **GEOMETRY)  # fmt: skip
    assert opt.partition_table()[0][2:4] == ("row", 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(momentum_dtype="fp16"), ValueError, "momentum_dtype"),
        (dict(sub_block=64), ValueError, "sub_block"),
        (dict(lr=-1.0), ValueError, "learning rate"),
        (dict(betas=(0.9, 1.0)), ValueError, "beta parameter at index 1"),
        (dict(n_kv_heads=3), ValueError, "n_kv_heads"),
        (dict(fallback_capacity=0.0), ValueError, "fallback_capacity"),
        (dict(model_sharding="yes"), TypeError, "model_sharding"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdamMini(gqa_model().named(), **{**GEOMETRY, **kwargs})


def test_adam_minis_model_sharding_flag_is_taken_and_ignored_with_a_warning():
    # adam-mini 1.1.1's keyword (always on there since 1.0.2): its calls switch by import
    model, twin = gqa_model(), gqa_model()
    with pytest.warns(RuntimeWarning, match="model_sharding is accepted for adam-mini's calls and ignored"):
        opt = AdamMini(model.named(), lr=1e-2, model_sharding=True, momentum_dtype="fp32", **GEOMETRY)
    assert steps_stay_equal(model, opt, twin, AdamMini(twin.named(), lr=1e-2, momentum_dtype="fp32", **GEOMETRY))


def test_plain_parameters_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="named parameters"):
        AdamMini(gqa_model().parameters(), **GEOMETRY)


def test_fp8_on_cpu_keeps_bf16_momentum_with_a_warning():
    model = gqa_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = AdamMini(model.named(), **GEOMETRY)
        fresh_grads(model)
        opt.step()
    assert any("bf16 momentum" in str(w.message) for w in caught)
    # raised under torch's constructor (add_param_group), attributed to the line that built it
    assert all(w.filename == __file__ for w in caught if "bf16 momentum" in str(w.message))
    assert {r[4] for r in opt.partition_table()} == {"bf16"}
    assert opt.state[model.params[0]]["exp_avg"].dtype == torch.bfloat16


def test_state_dict_round_trip_through_weights_only_load():
    build = lambda m: AdamMini(m.named(), lr=1e-2, weight_decay=0.1, momentum_dtype="bf16", **GEOMETRY)  # noqa: E731
    a = gqa_model()
    opt_a = build(a)
    b, opt_b = checkpoint_twin(a, opt_a, build)
    assert opt_b.state[b.params[0]]["exp_avg"].dtype == torch.bfloat16
    assert steps_stay_equal(a, opt_a, b, opt_b)


def test_an_added_group_is_partitioned_and_split_by_decay_as_the_constructor_does():
    # the layers given later (a model unfrozen in stages) step as if given at construction
    build = lambda named: AdamMini(named, lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", **GEOMETRY)  # noqa: E731
    whole, staged = gqa_model(), gqa_model()
    opt_whole = build(whole.named())
    first = len(staged.params) // 2
    opt = build(staged.named()[:first])
    opt.add_param_group({"params": staged.named()[first:]})
    assert sorted(opt.partition_table()) == sorted(opt_whole.partition_table())  # (name, shape, kind, blocks, dtype)
    assert {g["weight_decay"] for g in opt.param_groups[-2:]} == {0.1, 0.0}  # norms and biases do not decay
    assert all("step" in opt.state[p] for p in staged.params)
    assert steps_stay_equal(whole, opt_whole, staged, opt)
    with pytest.raises(TypeError, match="named parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})


def test_lr_scheduler_drives_every_group():
    model = gqa_model()
    opt = AdamMini(model.named(), lr=1e-2, weight_decay=0.1, momentum_dtype="fp32", **GEOMETRY)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.1, 0.0}  # norms and biases do not decay
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fresh_grads(model)
    opt.step()
    sched.step()
    assert {g["lr"] for g in opt.param_groups} == {5e-3}


# --- FP8 storage reference (torch's float8 casts run on CPU) ---


def _fp8_state(rows, cols, capacity=1 / 4):
    return new_fp8_state((rows, cols), rows, cols, "cpu", 128, capacity)


def test_fp8_round_trip_is_within_the_e4m3_rounding_bound():
    m = torch.randn(5, 300) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different scales
    state = _fp8_state(5, 300)
    bf16, overflow = quantize_(state, m, write_half=1)
    assert int(bf16) == int(overflow) == 0
    back = dequantize(state, 5, 300, read_half=1)
    for r in range(5):
        for j in range(0, 300, 128):
            x, y = m[r, j : j + 128], back[r, j : j + 128]
            # E4M3 normals round with relative error <= 2^-4 (3 mantissa bits), so normwise too.
            assert float((y - x).norm() / x.norm()) <= REL_ERROR_BOUND


def test_fp8_momentum_too_small_for_a_scale_is_stored_as_zero_not_nan():
    # Momentum under zero gradients decays by beta1 a step; below 448 / FLT_MAX, 448 / amax was inf
    # and a zero element's code 0 * inf = NaN (the old rule gave [1e-37, 1e-37, nan, nan, ...]).
    m = torch.zeros(3, 256)
    m[0, :2] = torch.tensor([1e-37, 3e-38])  # zeros beside it, as FP8 leaves in decayed rows
    m[1, 128:] = FLUSH_BELOW / 2  # a whole sub-block just under the threshold
    m[2] = torch.randn(256) * 1e-25  # well above it: kept
    state = _fp8_state(3, 256)
    bf16, overflow = quantize_(state, m, write_half=0)
    back = dequantize(state, 3, 256, read_half=0)
    assert back.isfinite().all() and int(bf16) == int(overflow) == 0
    assert (back[:2] == 0).all() and (state["exp_avg_scale"][:2] == 0).all()
    assert float((back[2] - m[2]).double().norm() / m[2].double().norm()) <= REL_ERROR_BOUND


def test_the_kernel_flushes_below_the_reference_threshold():
    # The template spells fp8.FLUSH_BELOW as a literal (Triton constexpr); the two must agree.
    import re

    from kernel_factory.generator import ADAM_MINI, render

    source = render(ADAM_MINI, ADAM_MINI.variant(multi_tensor=True, param_dtype="bfloat16", momentum="float8e4nv"))
    (literal,) = re.findall(r"^FLUSH_BELOW = tl\.constexpr\(([^)]*)\)$", source, re.MULTILINE)
    assert float(literal) == FLUSH_BELOW and "amax < FLUSH_BELOW" in source


def test_fp8_normwise_bound_is_never_what_sends_a_sub_block_to_bf16():
    # The kernel runs the fallback tests only in tiles with an element that rounds to zero, which
    # holds if the normwise bound alone never passes (fp8.py's docstring): each sub-block's
    # magnitudes log-uniform over 0.4 to 17 decades, so that most hold subnormal or zero codes.
    gen = torch.Generator().manual_seed(0)
    span = torch.linspace(1.0, 40.0, 2000)[:, None]  # natural log of the ratio largest / smallest
    m = torch.exp(-span * torch.rand(2000, 128, generator=gen)) * torch.randn(2000, 128, generator=gen).sign()
    state = _fp8_state(2000, 128, capacity=1.0)  # every request granted: pooled = wanted
    quantize_(state, m, write_half=0)
    pooled = state["exp_avg_scale"][:, 0] < 0
    inv = 448 / m.abs().amax(dim=1, keepdim=True)  # the reference's order: one division a sub-block
    zeros = ((m != 0) & ((m * inv).to(torch.float8_e4m3fn).float() == 0)).sum(dim=1)
    assert torch.equal(pooled, zeros > UNDERFLOW_FRACTION * 128) and 0 < int(pooled.sum()) < 2000
    back = dequantize(state, 2000, 128, read_half=0)
    err = (back - m).double().norm(dim=1) / m.double().norm(dim=1)
    assert float(err[~pooled].max()) <= REL_ERROR_BOUND


def test_fp8_underflow_falls_back_to_bf16_and_overflows_past_capacity():
    m = torch.randn(4, 256) * 1e-4
    m[:, ::128] = 100.0  # one huge element per sub-block: the rest underflows E4M3
    state = _fp8_state(4, 256, capacity=1 / 4)  # 2 slots for 8 sub-blocks
    bf16, overflow = quantize_(state, m, write_half=0)
    assert (int(bf16), int(overflow)) == (2, 6)
    back = dequantize(state, 4, 256, read_half=0)
    pooled = state["exp_avg_scale"] < 0
    assert int(pooled.sum()) == 2 and bool(pooled[0].all())  # slots go out in row-major order
    assert torch.allclose(back[0], m[0], rtol=2**-8)  # bf16 keeps the small values
    assert float((back[1, 1:128] == 0).float().mean()) > 0.9  # FP8 lost them
    assert int(state["exp_avg_pool_used"][0]) == 8 and int(state["exp_avg_pool_used"][1]) == 0


def test_a_channels_last_weight_steps_as_its_contiguous_copy():
    # the reference path read and wrote the parameter through .view, which a channels_last conv
    # weight refuses; it reads a copy and writes the result back in the parameter's layout
    gen = torch.Generator().manual_seed(0)
    w, grads = torch.randn(8, 4, 3, 3, generator=gen), [torch.randn(8, 4, 3, 3, generator=gen) for _ in range(2)]
    last = torch.nn.Parameter(w.clone().to(memory_format=torch.channels_last))
    plain = torch.nn.Parameter(w.clone())
    opts = [AdamMini([("conv.weight", p)], lr=1e-2, dim=8, n_heads=2) for p in (last, plain)]
    for g in grads:
        last.grad, plain.grad = g.to(memory_format=torch.channels_last), g.clone()
        for opt in opts:
            opt.step()
    assert last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(last, plain) and not torch.equal(plain, w)
