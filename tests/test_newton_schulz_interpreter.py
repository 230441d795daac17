"""The Triton Newton–Schulz kernels (fp32 variant) under TRITON_INTERPRET=1 vs torch's fp32 matmuls."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernel_factory.generator import NEWTON_SCHULZ, interpreter_enabled, load
from kernel_factory.optimizers.muon.newton_schulz import coefficient_schedule, iterate
from kernel_factory.optimizers.muon.newton_schulz_launch import (
    PRODUCTS,
    hopper_fits,
    joint_newton_schulz,
    normalized,
    per_product,
    triton_newton_schulz,
)
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
_walk = None  # the hopper kernels' tile walk, loaded by its test
FP32_TOL = 1e-5  # fp32 (IEEE dot, no tf32): rounding and summation order only, over 3 iterations
SMALL = dict(impl="classic", BLOCK=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2)
# hopper: 32 x 32 symmetric tiles in groups of 2 strips (a 5 x 5 tile grid at 160 walks three
# groups, the last of one strip), 32 x 64 update tiles; 4 programs walk the tiles persistently.
HOPPER = dict(SMALL, impl="hopper", BLOCK=32, BLOCK_N=64, GROUP_M=2)
# stream-K symmetric products with the hopper tiles (4 programs: the K steps of a tile are split
# between two or more of them); the update and joint launches take the hopper kernels.
STREAM_K = dict(HOPPER, impl="stream_k")


# (batch, m, n): one tile; several tiles with ragged edges (130: a 3 x 3 tile grid, 6 programs,
# mirrored writes; 160 x 200: whole off-diagonal tiles stored by TMA); a wide batch; tall
# matrices handed over as their transposed views (no copy).
@pytest.mark.parametrize("shape, tall", [((1, 40, 40), False), ((1, 130, 150), False), ((3, 40, 72), False),
                                         ((2, 72, 40), True), ((1, 160, 200), False), ((3, 64, 96), False),
                                         ((2, 96, 64), True)])  # fmt: skip
@pytest.mark.parametrize("config", [SMALL, HOPPER, STREAM_K], ids=["classic", "hopper", "stream_k"])
def test_fp32_kernels_match_torch(shape, tall, config):
    assert NEWTON_SCHULZ.is_legal(config)
    x = torch.randn(shape)
    x = x.mT if tall else x
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    hopper = config["impl"] in ("hopper", "stream_k") and hopper_fits(x, config, "update")
    for coefficients in (None, "polar_express"):
        schedule = coefficient_schedule(coefficients, 3)
        out = triton_newton_schulz(x, schedule, config)
        assert out.shape == x.shape and (out.mT if hopper and tall else out).is_contiguous()
        assert compare_tensors("ns", "X", out, iterate(x, schedule, dict(config, impl="torch")), FP32_TOL).passed


# Each product takes its own config: the kernels of one product hand over to another's in any
# layout (the hopper update leaves a tall x in its transposed storage; torch's matmuls take any).
TORCH = dict(SMALL, impl="torch")
MIXED = [dict(gram=HOPPER, poly=SMALL, update=TORCH), dict(gram=SMALL, poly=TORCH, update=HOPPER),
         dict(gram=TORCH, poly=HOPPER, update=SMALL)]  # fmt: skip


@pytest.mark.parametrize("shape, tall", [((3, 64, 96), False), ((2, 96, 64), True)])
@pytest.mark.parametrize("configs", MIXED, ids=["hopper-classic-torch", "classic-torch-hopper", "torch-hopper-classic"])
def test_each_product_runs_its_own_config(shape, tall, configs):
    x = torch.randn(shape)
    x = x.mT if tall else x
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    schedule = coefficient_schedule(None, 3)
    out = triton_newton_schulz(x, schedule, configs)
    assert out.shape == x.shape
    assert compare_tensors("ns", "X", out, iterate(x, schedule, TORCH), FP32_TOL).passed


# Batches of other shapes share the hopper launches, two a launch (three batches: a second launch
# with one); a tall one among them; the classic and torch configs run them one by one.
JOINT = [((3, 64, 96), False), ((2, 32, 160), False), ((2, 96, 64), True)]


@pytest.mark.parametrize("config", [SMALL, HOPPER, STREAM_K, TORCH], ids=["classic", "hopper", "stream_k", "torch"])
@pytest.mark.parametrize("scaled", [False, True], ids=["normalized", "norms"])
def test_joint_iterations_match_each_batch_alone(config, scaled):
    # With norms, each x[b] stands for x[b] / norm[b]: the first products scale by it on the fly
    # (the torch config divides first); a norm of inf gives 0 as torch's x / inf does.
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=gen) for shape, _ in JOINT]
    xs = [x.mT if tall else x for x, (_, tall) in zip(xs, JOINT, strict=True)]
    norms = [torch.linalg.vector_norm(x, dim=(-2, -1)) for x in xs]
    norms[1][0] = float("inf")
    inputs = [x / norm[:, None, None] for x, norm in zip(xs, norms, strict=True)]
    schedule = coefficient_schedule(None, 3)
    outs = joint_newton_schulz(xs, schedule, config, norms) if scaled else joint_newton_schulz(inputs, schedule, config)
    for x, out in zip(inputs, outs, strict=True):
        assert compare_tensors("ns", "X", out, iterate(x, schedule, TORCH), FP32_TOL).passed
    assert torch.equal(outs[1][0], torch.zeros_like(outs[1][0]))


def test_a_tuned_torch_update_of_unnormalized_batches_starts_on_the_scaling_kernels(monkeypatch):
    # A torch config carries the family default's tiles; with norms, the first update runs on the
    # hopper kernels with them, scaling by the norm (no division of x first), the later ones on
    # torch's matmuls: the same iterates as on normalized inputs.
    from kernel_factory.optimizers.muon import newton_schulz_launch

    configs = {"gram": HOPPER, "poly": HOPPER, "update": dict(NEWTON_SCHULZ.default_config, impl="torch")}
    monkeypatch.setattr(newton_schulz_launch, "normalized", lambda *_: pytest.fail("x was divided first"))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, generator=gen) for shape, _ in JOINT]
    xs = [x.mT if tall else x for x, (_, tall) in zip(xs, JOINT, strict=True)]
    norms = [torch.linalg.vector_norm(x, dim=(-2, -1)) for x in xs]
    norms[1][0] = float("inf")
    schedule = coefficient_schedule(None, 3)
    outs = joint_newton_schulz(xs, schedule, configs, norms)
    for x, norm, out in zip(xs, norms, outs, strict=True):
        assert compare_tensors("ns", "X", out, iterate(x / norm[:, None, None], schedule, TORCH), FP32_TOL).passed
    assert torch.equal(outs[1][0], torch.zeros_like(outs[1][0]))
    assert outs[2].mT.is_contiguous()  # the tall batch's O in its layout: its rows contiguous (Muon's owners copy them)


def test_normalized_has_the_bits_of_the_fp32_quotient_rounded_to_bf16():
    # Muon's norms are bf16 values (torch's bf16 vector_norm): divided as bf16, the same bits as
    # x.float() / norm rounded to bf16 (one launch in place of three); x's layout kept.
    gen = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-8, 4, (4, 1, 1), generator=gen).float()
    x = (torch.randn(4, 96, 64, generator=gen) * scales).bfloat16().mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1)).float()
    out = normalized(x, norm)
    assert out.dtype == torch.bfloat16 and out.stride() == x.stride()
    assert torch.equal(out.view(torch.int16), x.float().div(norm[:, None, None]).to(torch.bfloat16).view(torch.int16))


def test_per_product_configs_name_every_product():
    assert per_product(SMALL) == {p: SMALL for p in PRODUCTS}
    with pytest.raises(ValueError, match="one per product"):
        per_product(dict(gram=SMALL, update=SMALL))


def test_hopper_kernels_take_only_batches_whose_contraction_ends_at_a_matrix_edge():
    # In a batch a TMA block reads on into the next matrix where the contraction runs along the
    # descriptor's rows: the update's over m, and the Gram product's over n for a transposed x.
    assert all(hopper_fits(torch.empty(2, 64, 96), HOPPER, p) for p in PRODUCTS)
    assert not hopper_fits(torch.empty(2, 40, 96), HOPPER, "update")  # m = 40: the update reads past it
    assert hopper_fits(torch.empty(2, 40, 96), HOPPER, "gram")  # along a row TMA fills zeros
    assert hopper_fits(torch.empty(1, 40, 72), HOPPER, "update")  # one matrix: no neighbour
    tall = torch.empty(2, 72, 64).mT
    assert not hopper_fits(tall, HOPPER, "gram") and hopper_fits(tall, HOPPER, "update")  # n = 72
    assert not hopper_fits(torch.empty(1, 42, 64), HOPPER, "gram")  # rows of 42 fp32: not 16-byte multiples
    assert not hopper_fits(torch.empty(1 + 64 * 96)[1:].view(1, 64, 96), HOPPER, "gram")  # starts 4 bytes off


def test_rejects_tall_or_unsupported_inputs():
    with pytest.raises(ValueError, match="m <= n"):
        triton_newton_schulz(torch.randn(1, 72, 40), coefficient_schedule(None, 1), SMALL)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        triton_newton_schulz(torch.randn(1, 8, 8, dtype=torch.float64), coefficient_schedule(None, 1), SMALL)


@triton.jit
def _visit(out_ptr, nt, GROUP_M: tl.constexpr):
    t = tl.program_id(0)
    i, j = _walk(t, nt, GROUP_M)
    tl.store(out_ptr + 2 * t, i)
    tl.store(out_ptr + 2 * t + 1, j)


def test_the_hopper_symmetric_walk_visits_each_upper_tile_once():
    # The closed form of the grouped walk over the triangle, for grids of 1 to 13 tiles a side
    # and groups that divide the grid, do not, or exceed it. (The interpreter looks _walk up
    # in this module when _visit runs.)
    global _walk
    _walk = load(NEWTON_SCHULZ, NEWTON_SCHULZ.variant(dtype="float32", variant="hopper"))._grouped_upper_tile
    for nt in range(1, 14):
        upper = sorted((i, j) for i in range(nt) for j in range(i, nt))
        for group in (1, 2, 3, 4, 8, 16):
            out = torch.full((len(upper), 2), -1, dtype=torch.int32)
            _visit[(len(upper),)](out, nt, GROUP_M=group)
            got = [tuple(r) for r in out.tolist()]
            assert sorted(got) == upper, (nt, group)
            # a group's strips come before the next group's
            assert [i // group for i, _ in got] == sorted(i // group for i, _ in got), (nt, group)


class _RecordingKernel:
    """A kernel stand-in: ``kernel[grid](one, two)`` records (one, two); a two-part launch raises
    ``OutOfResources`` where ``too_big``."""

    def __init__(self, calls: list, too_big: bool) -> None:
        self.calls, self.too_big = calls, too_big

    def __getitem__(self, grid):
        def launch(one, two):
            from triton.runtime.errors import OutOfResources

            self.calls.append((one, two))
            if two is not None and self.too_big:
                raise OutOfResources(262144, 232448, "shared memory")

        return launch


def test_a_pair_that_does_not_fit_in_shared_memory_launches_its_batches_one_by_one():
    # The two-part kernel may need more shared memory than either part alone: such a config
    # warns once and from then on launches each part alone, without trying the pair again.
    from kernel_factory.optimizers.muon import newton_schulz_launch as nst

    calls = []
    kernel = _RecordingKernel(calls, too_big=True)
    launch = lambda one, two: nst._issue(kernel, (1,), (one, two), {})  # noqa: E731
    config = dict(HOPPER, num_stages=5)
    with pytest.warns(RuntimeWarning, match="one by one"):
        nst._launch_pair("update", config, "a", "b", launch)
    nst._launch_pair("update", config, "c", "d", launch)
    nst._launch_pair("update", config, "e", None, launch)
    assert calls == [("a", "b"), ("a", None), ("b", None), ("c", None), ("d", None), ("e", None)]
    nst._UNPAIRED.clear()


def test_a_pair_still_compiling_in_the_background_launches_its_parts_one_by_one(monkeypatch):
    from kernel_factory.optimizers.muon import newton_schulz_launch as nst
    from kernel_factory.optimizers.shared import precompile

    calls = []
    kernel = _RecordingKernel(calls, too_big=False)
    launch = lambda one, two: nst._issue(kernel, (1,), (one, two), {})  # noqa: E731
    asked = []
    pending = True
    monkeypatch.setattr(precompile, "ready", lambda k, args, kwargs: (asked.append(args), not pending)[1])
    nst._launch_pair("sym", HOPPER, "a", "b", launch)
    pending = False
    nst._launch_pair("sym", HOPPER, "c", "d", launch)
    assert asked == [("a", "b"), ("c", "d")]  # the pair's own launch is what is asked about
    assert calls == [("a", None), ("b", None), ("c", "d")]


def _issued(ns) -> bool:
    """Whether a launch passing through ``ns._issue`` now runs (not recorded by ``_recorded``)."""
    return getattr(ns._collecting, "launches", None) is None


@pytest.mark.parametrize("shapes", [[(2, 64, 96), (3, 64, 96)], [(3, 130, 150), (1, 40, 72)]])
def test_pairs_launched_one_by_one_give_the_same_bits(shapes, monkeypatch):
    """The first steps' one-part launches and the later two-part ones compute every tile alike:
    a process's results do not depend on when its background compiles finished."""
    from kernel_factory.optimizers.muon import newton_schulz_launch as nst
    from kernel_factory.optimizers.shared import precompile

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(*shape, generator=gen) for shape in shapes]
    xs[1] = xs[1].mT.contiguous().mT  # a batch handed over as a transposed view
    norms = [torch.linalg.vector_norm(x, dim=(-2, -1)) for x in xs]
    schedule = coefficient_schedule(None, 2)
    paired = joint_newton_schulz(xs, schedule, HOPPER, norms)
    launched = []
    real = nst._issue
    monkeypatch.setattr(nst, "_issue", lambda k, grid, args, kwargs: (_issued(nst) and launched.append(
        kwargs.get("TWO_PARTS")), real(k, grid, args, kwargs)))  # fmt: skip
    monkeypatch.setattr(precompile, "ready", lambda *a: False)
    one_by_one = joint_newton_schulz(xs, schedule, HOPPER, norms)
    assert True not in launched and False in launched
    for a, b in zip(paired, one_by_one, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("configs", [SMALL, HOPPER, MIXED[1]], ids=["classic", "hopper", "classic-torch-hopper"])
def test_collected_launches_are_the_ones_a_run_issues(configs, monkeypatch):
    """precompile.py compiles what ``collect_launches`` finds (meta stand-ins, nothing run): the
    same kernels, grids, constexprs and argument kinds as a real joint run of two batches with
    norms (the scaled first iteration, a transposed batch) issues while its two-part hopper
    kernels still compile (parts one by one), and, apart, the two-part launches of a later run."""
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns
    from kernel_factory.optimizers.shared import precompile
    from kernel_factory.optimizers.shared.precompile import _signature

    xs = [torch.randn(2, 64, 96), torch.randn(3, 96, 64).mT]
    norms = [torch.linalg.vector_norm(x, dim=(-2, -1)) for x in xs]
    schedule = coefficient_schedule(None, 2)
    real = ns._issue

    def issued_with(ready: bool) -> list[tuple]:
        issued = []
        monkeypatch.setattr(ns, "_issue", lambda k, grid, args, kwargs: (_issued(ns) and issued.append(
            (k, grid, args, kwargs)), real(k, grid, args, kwargs)))  # fmt: skip
        monkeypatch.setattr(precompile, "ready", lambda *a: ready)
        joint_newton_schulz(xs, schedule, configs, norms)
        monkeypatch.setattr(ns, "_issue", real)
        return issued

    first_steps, later = issued_with(False), issued_with(True)
    collected, pairs = ns.collect_launches(xs, schedule, norms, configs)
    key = lambda launch: (launch[1], _signature(*(launch[i] for i in (0, 2, 3))))  # noqa: E731
    assert first_steps and [key(la) for la in collected] == [key(la) for la in first_steps]
    two_part = [la for la in later if la[3].get("TWO_PARTS")]
    assert [key(la) for la in pairs] == [key(la) for la in two_part]
    assert bool(pairs) == (configs is not SMALL)  # hopper products launch in pairs
    collected = collected + pairs
    assert all(t.is_meta for la in collected for t in la[2] if isinstance(t, torch.Tensor))


# (batch, m, k): tiles cut between two programs (130 x 150: 15 tiles of 5 K steps over 4
# programs); between three or more, a program's whole run inside one tile (64 x 512: 3 tiles of
# 16 K steps, 12 steps a program); a tile's first K steps in one program (40 x 40: 3 tiles of 2);
# fewer K steps than programs (32 x 64: one tile of 2, runs of 0 and 1 steps, an empty run inside
# the tile handing over a zero partial); a batch; a tall x read in its transposed storage.
@pytest.mark.parametrize("shape, tall", [((1, 130, 150), False), ((1, 64, 512), False), ((1, 40, 40), False),
                                         ((1, 32, 64), False), ((3, 64, 96), False), ((2, 96, 64), True)])  # fmt: skip
def test_stream_k_symmetric_products_match_torch_and_repeat_their_bits(shape, tall, monkeypatch):
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns

    monkeypatch.setattr(ns, "_hopper_symmetric", lambda *a: pytest.fail("one batch took the tile-per-program kernel"))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape[0], shape[2], shape[1], generator=gen).mT if tall else torch.randn(shape, generator=gen)
    norm = torch.rand(shape[0], generator=gen) + 0.5
    c = torch.randn(shape[0], shape[1], shape[1], generator=gen)
    c = c + c.mT
    gram, poly = torch.empty_like(c), torch.empty_like(c)
    ns.symmetric_product([x], [gram], None, 1.0, 0.0, STREAM_K, [norm])
    ns.symmetric_product([c], [poly], [c], 0.7, 0.3, STREAM_K, gamma=0.5)
    want_gram = x @ x.mT / norm[:, None, None] ** 2
    want_poly = 0.7 * c @ c.mT + 0.3 * c + 0.5 * torch.eye(shape[1])
    assert compare_tensors("ns", "gram", gram, want_gram, FP32_TOL).passed
    assert compare_tensors("ns", "poly", poly, want_poly, FP32_TOL).passed
    again = torch.empty_like(gram)
    ns.symmetric_product([x], [again], None, 1.0, 0.0, STREAM_K, [norm])
    assert torch.equal(again, gram)  # the partial sums add in one order
    assert all(int(flags.abs().sum()) == 0 for _, flags in ns._STREAM_WORKSPACES.values())  # lowered again


def test_stream_k_collected_launches_are_the_ones_a_run_issues(monkeypatch):
    """precompile.py compiles the stream-K kernel a one-batch run issues (its workspace a meta
    stand-in while collecting)."""
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns
    from kernel_factory.optimizers.shared.precompile import _signature

    xs = [torch.randn(1, 96, 64).mT]
    norms = [torch.linalg.vector_norm(x, dim=(-2, -1)) for x in xs]
    schedule = coefficient_schedule(None, 2)
    issued, real = [], ns._issue
    monkeypatch.setattr(ns, "_issue", lambda k, grid, args, kwargs: (_issued(ns) and issued.append(
        (k, grid, args, kwargs)), real(k, grid, args, kwargs)))  # fmt: skip
    joint_newton_schulz(xs, schedule, STREAM_K, norms)
    monkeypatch.setattr(ns, "_issue", real)
    collected, pairs = ns.collect_launches(xs, schedule, norms, STREAM_K)
    key = lambda launch: (launch[1], _signature(*(launch[i] for i in (0, 2, 3))))  # noqa: E731
    assert [key(la) for la in collected] == [key(la) for la in issued] and not pairs
    assert sum("NUM_PROGRAMS" in la[3] for la in collected) == 4  # gram and poly of each iteration
    assert all(t.is_meta for la in collected for t in la[2] if isinstance(t, torch.Tensor))
