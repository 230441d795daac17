"""Newton–Schulz kernels and Muon on a CUDA GPU (the -m gpu tier)."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import NEWTON_SCHULZ
from kernel_factory.optimizers import Muon, fast_newton_schulz
from kernel_factory.optimizers.muon.newton_schulz import coefficient_schedule, iterate, reference_newton_schulz
from kernel_factory.optimizers.muon.newton_schulz_launch import normalized, symmetric_product
from kernel_factory.optimizers.muon.plan import TritonBatch
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NS_TOL = 2e-2  # bf16 intermediates, rounded in a different order than cuBLAS's (tests/test_muon_cpu.py)
CLASSIC = dict(NEWTON_SCHULZ.default_config, impl="classic")
HOPPER = dict(NEWTON_SCHULZ.seed_configs[1])
HOPPER_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
STREAM_K = dict(NEWTON_SCHULZ.seed_configs[-1])


# Square, wide, tall (a transposed view, no copy), batched (also tall), ragged tile edges, one tile,
# a batch whose m is not a multiple of BLOCK_K (the hopper config falls back to the classic kernels).
@pytest.mark.parametrize("shape", [(1024, 1024), (512, 1536), (1536, 512), (6, 768, 768), (4, 2048, 768),
                                   (1000, 333), (3, 64, 64), (1, 1000, 1336), (2, 200, 328)])  # fmt: skip
@pytest.mark.parametrize("config", [CLASSIC, HOPPER, STREAM_K], ids=["classic", "hopper", "stream_k"])
def test_triton_kernels_match_torchs_bf16_ns5(shape, config):
    if config["impl"] in ("hopper", "stream_k") and not HOPPER_GPU:
        pytest.skip("the hopper kernels need TMA (sm90 and up)")
    g = torch.randn(shape, device="cuda")
    x = g.bfloat16()
    x = x.mT if x.shape[-2] > x.shape[-1] else x
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    schedule = coefficient_schedule(None, 5)
    out = iterate(x, schedule, config)
    ref = iterate(x, schedule, dict(config, impl="torch"))
    assert compare_tensors("ns", "X", out, ref, NS_TOL).passed
    # and the public entry point (the tuned choice) against torch.optim.Muon's iteration
    assert compare_tensors("ns", "O", fast_newton_schulz(g), reference_newton_schulz(g), NS_TOL).passed


# One matrix of a Llama-3.2-1B MLP, wide and tall (its Gram product: 136 tiles of 128 K steps
# split over the SMs), and 2048^2 with norms (the scaled first iteration).
@pytest.mark.parametrize("shape, scaled", [((1, 2048, 8192), False), ((1, 8192, 2048), False), ((1, 2048, 2048), True)])
def test_stream_k_symmetric_products_match_torch_and_repeat_their_bits(shape, scaled):
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns

    if not HOPPER_GPU:
        pytest.skip("the stream-K kernel needs TMA (sm90 and up)")
    a, b, c = coefficient_schedule(None, 1)[0]
    x = torch.randn(shape, device="cuda").bfloat16()
    x = x.mT if shape[1] > shape[2] else x
    norm = torch.linalg.vector_norm(x.float(), dim=(-2, -1)) if scaled else None
    m = x.shape[1]
    gram, again, poly = (torch.empty(1, m, m, dtype=x.dtype, device="cuda") for _ in range(3))
    ns.symmetric_product([x], [gram], None, 1.0, 0.0, STREAM_K, None if norm is None else [norm])
    xn = x if norm is None else (x.float() / norm[:, None, None]).bfloat16()
    want = torch.bmm(xn, xn.mT)
    assert compare_tensors("ns", "gram", gram, want, NS_TOL).passed
    ns.symmetric_product([gram], [poly], [gram], c, b, STREAM_K, gamma=a)
    eye = torch.eye(m, device="cuda", dtype=x.dtype)
    want = torch.baddbmm(gram, gram, gram, beta=b, alpha=c) + a * eye
    assert compare_tensors("ns", "poly", poly, want, NS_TOL).passed
    for _ in range(3):
        ns.symmetric_product([x], [again], None, 1.0, 0.0, STREAM_K, None if norm is None else [norm])
        assert torch.equal(again, gram)  # the partial sums add in one order
    assert all(int(flags.abs().sum()) == 0 for _, flags in ns._STREAM_WORKSPACES.values())


def test_normalized_on_cuda_has_the_bits_of_the_fp32_quotient_rounded_to_bf16():
    # CUDA divides bf16 tensors in fp32 (a tensor divisor: no reciprocal), rounding once.
    scales = 10.0 ** torch.randint(-8, 4, (6, 1, 1), device="cuda").float()
    x = (torch.randn(6, 768, 2048, device="cuda") * scales).bfloat16()
    for xb in (x, x.mT):
        norm = torch.linalg.vector_norm(xb, dim=(-2, -1)).float()
        expected = xb.float().div(norm[:, None, None]).to(torch.bfloat16)
        assert torch.equal(normalized(xb, norm).view(torch.int16), expected.view(torch.int16))


def _exact_ns(x: torch.Tensor, schedule) -> torch.Tensor:
    """The NS iterations in fp64 on the normalized x (B, m, n), m <= n: what bf16 rounds."""
    x = x.double()
    for a, b, c in schedule:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


@pytest.mark.parametrize("shape", [(1024, 1024), (2, 768, 2048), (3, 2048, 768)])
@pytest.mark.parametrize("coefficients", [None, "polar_express"], ids=["ns5", "polar_express"])
@pytest.mark.parametrize("config", [CLASSIC, HOPPER], ids=["classic", "hopper"])
def test_kernels_are_as_close_to_exact_ns_as_torchs_bf16(shape, coefficients, config):
    # The poly product folds a I into Bm before rounding it to bf16 (the template says why), so the
    # kernels sit about 1% from torch's bf16 NS5: each is a bf16 rounding of the same iteration.
    # What matters is the distance to the iteration in exact arithmetic: no more than torch's own
    # (within 25%: fresh random inputs; emulated on the CPU the two differ by 2 to 13%).
    if config["impl"] == "hopper" and not HOPPER_GPU:
        pytest.skip("the hopper kernels need TMA (sm90 and up)")
    x = torch.randn(shape, device="cuda").bfloat16()
    x = (x if x.dim() == 3 else x[None]).float()
    x = x.mT if x.shape[-2] > x.shape[-1] else x
    x = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).bfloat16()
    schedule = coefficient_schedule(coefficients, 5)
    exact = _exact_ns(x, schedule)
    ours = iterate(x, schedule, config).double()
    torchs = iterate(x, schedule, dict(config, impl="torch")).double()
    distance = lambda y: float((y - exact).norm() / exact.norm())  # noqa: E731
    assert torch.isfinite(ours).all()
    assert distance(ours) <= 1.25 * distance(torchs), (distance(ours), distance(torchs))


@pytest.mark.parametrize("shape", [(3, 768, 768), (2, 1000, 1336), (1, 2048, 768)])
@pytest.mark.parametrize("config", [CLASSIC, HOPPER], ids=["classic", "hopper"])
def test_symmetric_products_are_exactly_symmetric(shape, config):
    # The poly product reads its input as symmetric (A A = A Aᵀ) and the tall update reads Bm so:
    # mirrored tiles are copies, and a diagonal tile computed whole must come out symmetric too.
    if config["impl"] == "hopper" and not HOPPER_GPU:
        pytest.skip("the hopper kernels need TMA (sm90 and up)")
    x = torch.randn(shape, device="cuda").bfloat16()
    x = x.mT if x.shape[-2] > x.shape[-1] else x
    gram = torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype, device="cuda")
    symmetric_product([x], [gram], None, 1.0, 0.0, config)
    poly = torch.empty_like(gram)
    symmetric_product([gram], [poly], [gram], 2.0315, -4.775, config, gamma=3.4445)
    for out in (gram, poly):
        assert torch.equal(out, out.mT)
    assert compare_tensors("ns", "A", gram, torch.bmm(x, x.mT), NS_TOL).passed


def _misaligned(values):
    """A copy of ``values`` 4 bytes past a 16-byte boundary: its batch takes per-matrix launches."""
    storage = torch.empty(values.numel() + 8 // values.element_size(), dtype=values.dtype, device=values.device)
    out = storage[4 // values.element_size():][: values.numel()].view(values.shape)
    return out.copy_(values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_on_cuda_matches_torch_muon_over_10_steps(dtype, nesterov, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)] * 2 + [(300, 100)]
    ours = [(torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype) for s in shapes]
    ours.append(_misaligned((torch.randn(100, 300, device="cuda", generator=gen) * 0.02).to(dtype)))
    theirs = [p.clone() for p in ours]
    start = [p.clone() for p in ours]
    if dtype == torch.bfloat16 and not nesterov:
        # torch.optim.Muon's NS starts with grad.bfloat16().div_(norm): on bf16 momentum without
        # nesterov that is the buffer itself, normalized in place every step. Ours leaves the
        # buffer alone; the oracle gets a copy to normalize.
        ns = torch.optim._muon._zeropower_via_newtonschulz
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", lambda g, *a: ns(g.clone(), *a))
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    opt_ours, opt_theirs = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(10):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            q.grad = p.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    batches = {(b.m, b.n): b for plan in opt_ours._plans.values() for b in plan.batches}
    assert all(isinstance(b, TritonBatch) for b in batches.values())
    assert batches[(768, 2048)].multi_tensor and not batches[(100, 300)].multi_tensor
    # fp32 params: p = p0 (1 - lr wd)^10 (exact in both) minus the 10 steps lr O, and O is a bf16
    # NS, ours and torch's each a bf16 rounding of the same iteration, NS_TOL apart at most
    # (test_kernels_are_as_close_to_exact_ns_as_torchs_bf16): what the steps moved must agree
    # within NS_TOL. bf16 params round every stored step to 8 bits: bf16's 1e-2 (parity/matrix.py's
    # bound). The momentum buffers' lerp is torch's formula: fp32 rounding only.
    buf_tol = 1e-6 if dtype == torch.float32 else 1e-2
    decay = (1 - kw["lr"] * kw["weight_decay"]) ** 10
    for i, (p, q, p0) in enumerate(zip(ours, theirs, start, strict=True)):
        if dtype == torch.float32:
            assert compare_tensors(f"p{i}", "param moved", p - p0 * decay, q - p0 * decay, NS_TOL).passed
        else:
            assert compare_tensors(f"p{i}", "param", p, q, 1e-2).passed
        buf_p, buf_q = opt_ours.state[p]["momentum_buffer"], opt_theirs.state[q]["momentum_buffer"]
        assert compare_tensors(f"p{i}", "momentum_buffer", buf_p, buf_q, buf_tol).passed


@pytest.mark.parametrize("config", [CLASSIC, HOPPER], ids=["classic", "hopper"])
def test_small_batches_replay_a_cuda_graph_with_the_same_result(config):
    if config["impl"] == "hopper" and not HOPPER_GPU:
        pytest.skip("the hopper kernels need TMA (sm90 and up)")
    from kernel_factory.optimizers.muon.newton_schulz_launch import graphed_newton_schulz, triton_newton_schulz

    schedule = coefficient_schedule(None, 5)
    for _ in range(2):  # the second call replays the graph on new values
        x = torch.randn(2, 512, 1024, device="cuda").bfloat16()
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        assert torch.equal(graphed_newton_schulz(x, schedule, config), triton_newton_schulz(x, schedule, config))
    tall = torch.randn(1, 1024, 512, device="cuda").bfloat16().mT  # a strided view goes through a copy
    tall = tall / torch.linalg.vector_norm(tall, dim=(-2, -1), keepdim=True)
    assert compare_tensors("ns", "X", graphed_newton_schulz(tall, schedule, config),
                           triton_newton_schulz(tall, schedule, config), 1e-3).passed  # fmt: skip


def test_graph_cache_keeps_its_inputs_within_its_byte_budget(monkeypatch):
    # A 2048 x 8192 matrix (2^24 elements) is replayed from a graph; the least recently used graphs
    # go once the cached inputs would pass the budget (here two 1024 x 2048 inputs).
    import kernel_factory.optimizers.muon.newton_schulz_launch as launch

    schedule = coefficient_schedule(None, 5)
    monkeypatch.setattr(launch, "_graphs", type(launch._graphs)())
    x = torch.randn(1, 2048, 8192, device="cuda").bfloat16()
    launch.graphed_newton_schulz(x / torch.linalg.vector_norm(x), schedule, CLASSIC)
    assert [k[0] for k in launch._graphs] == [(1, 2048, 8192)]
    monkeypatch.setattr(launch, "_GRAPH_CACHE_BYTES", 2 * 1024 * 2048 * 2)
    for m in (1024, 1023, 1022):
        x = torch.randn(1, m, 2048, device="cuda").bfloat16()
        launch.graphed_newton_schulz(x / torch.linalg.vector_norm(x), schedule, CLASSIC)
    assert [k[0] for k in launch._graphs] == [(1, 1023, 2048), (1, 1022, 2048)]


def test_muon_graphed_iterations_equal_direct_launches(monkeypatch):
    # The batch's CUDA graph reads its static NS input in place and replays the kernels the direct
    # path launches: the same bits every step, also after a plan rebuild (new input buffer) and
    # with a new coefficient schedule (a new capture).
    import kernel_factory.optimizers.muon.plan as muon_plan

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(768, 768)] * 3 + [(1024, 384)] * 2 + [(384, 1024)]
    init = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=gen) for s in shapes] for _ in range(4)]
    results = {}
    for graphed in (True, False):
        monkeypatch.setattr(muon_plan, "GRAPH_NS", graphed)
        params = [p.clone() for p in init]
        opt = Muon(params, lr=0.02, weight_decay=0.1)
        for step, gs in enumerate(grads):
            if step == 2:
                opt.param_groups[0]["ns_coefficients"] = "polar_express"
            if step == 3:  # a rebuilt plan: a new batch, a new input buffer
                opt._plans.clear()
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        plans = list(opt._plans.values())
        assert all(isinstance(b, TritonBatch) for plan in plans for b in plan.batches)
        assert [(ns._graph is not None) == graphed for plan in plans for ns in plan.joint] == [True]
        results[graphed] = params
    for p, q in zip(results[True], results[False], strict=True):
        assert torch.equal(p, q)


def test_pairs_launched_one_by_one_give_the_same_bits_on_the_gpu(monkeypatch):
    """A process's first steps launch each pair of hopper parts one by one while the two-part
    kernels compile (newton_schulz_launch._launch_pair): the 134M list's hidden batches, NS5 with the
    tuned configs, bit for bit the two-part launches' result."""
    if not HOPPER_GPU:
        pytest.skip("the hopper kernels need TMA (sm90 and up)")
    from kernel_factory.optimizers.muon import newton_schulz_launch as ns
    from kernel_factory.optimizers.shared import precompile

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(12, 768, 768), (24, 256, 768), (12, 768, 2048), (12, 2048, 768)]  # attention, GQA k/v, MLP
    xs = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in shapes]
    xs = [x.mT if x.shape[-2] > x.shape[-1] else x for x in xs]
    norms = [torch.linalg.vector_norm(x.float(), dim=(-2, -1)) for x in xs]
    schedule = coefficient_schedule(None, 5)
    two_parts = []
    real = ns._issue
    monkeypatch.setattr(ns, "_issue", lambda k, grid, args, kwargs: (
        getattr(ns._collecting, "launches", None) is None and two_parts.append(bool(kwargs.get("TWO_PARTS"))),
        real(k, grid, args, kwargs)))  # fmt: skip
    paired = ns.joint_newton_schulz(xs, schedule, norms=norms)
    assert any(two_parts), "no two-part launch: the test would compare a run with itself"
    two_parts.clear()
    monkeypatch.setattr(precompile, "ready", lambda *a: False)
    one_by_one = ns.joint_newton_schulz(xs, schedule, norms=norms)
    assert two_parts and not any(two_parts)
    for a, b in zip(paired, one_by_one, strict=True):
        assert torch.equal(a, b)
