"""Launches of the Triton Newton–Schulz kernels (kernel_templates/newton_schulz.py.j2)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from kernel_factory.generator import NEWTON_SCHULZ, detect_arch, interpreter_enabled, load, select

TRITON_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def iteration_flops(batch: int, m: int, n: int) -> int:
    """FLOPs of one NS iteration on (batch, m, n), m <= n, with full products: X Xᵀ and B X
    (2 m² n each) and A A (2 m³). The tuned cache's size key for this family."""
    return batch * (4 * m * m * n + 2 * m**3)


PRODUCTS = ("gram", "poly", "update")  # the family's product axis: the three products of an iteration


def per_product(config: Mapping) -> dict[str, Mapping]:
    """One config per product: ``config`` itself when it maps product names to configs, else
    the one family config (with its ``impl``) for all three."""
    if "impl" in config:
        return {product: config for product in PRODUCTS}
    if set(config) != set(PRODUCTS):
        raise ValueError(f"Newton-Schulz configs must be one config or one per product {PRODUCTS}, "
                         f"got {sorted(config)}")  # fmt: skip
    return dict(config)


def ns_config(x: Tensor) -> dict[str, Mapping]:
    """The tuned config of each product (``PRODUCTS``) for x ((m, n) or (B, m, n), m <= n): by its
    dtype and work (the family default on CPU)."""
    arch = "cpu" if x.device.type == "cpu" else detect_arch(x.device)
    dtype = TRITON_DTYPES[x.dtype]
    # Keyed by the work of the whole batch, which tells the batches of Muon apart: the elements
    # alone do not (36 of 768 x 2048 is as many as one 8192^2), and how many tiles a tile size
    # gives matters as much as the matrix size (one 1024^2 wants small tiles, 48 of 768^2 large).
    # Each product has its own config: at 48 x 768^2 the Gram product runs fastest on the
    # classic kernels and the update on the hopper ones (H200).
    work = iteration_flops(*x.shape) if x.dim() == 3 else iteration_flops(1, *x.shape)
    return {product: select(NEWTON_SCHULZ, arch, NEWTON_SCHULZ.variant(dtype=dtype, product=product), dtype, work)
            for product in PRODUCTS}  # fmt: skip


def triton_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]],
                         config: Mapping | None = None) -> Tensor:  # fmt: skip
    """The iterations of ``schedule`` on x (B, m, n), m <= n, already normalized; x may be any
    strided view (a transposed tall matrix) and is not written. bf16 or fp32 (the interpreter's).
    ``config``: one newton_schulz config or one per product (``per_product``); each product's
    ``impl`` picks its kernels: "classic", "hopper" where ``hopper_fits`` (else the classic ones
    with the same tiles) or "torch" (torch's batched matmuls). Returns a new (B, m, n) tensor of
    x's dtype: contiguous, or where the update runs the hopper kernel on a transposed x, the
    transposed view of a contiguous (B, n, m) one."""
    if x.dtype not in TRITON_DTYPES or x.dim() != 3 or x.shape[1] > x.shape[2]:
        raise ValueError(f"triton_newton_schulz takes (B, m, n), m <= n, bf16 or fp32; got {tuple(x.shape)} {x.dtype}")
    configs = per_product(config or ns_config(x))
    batch, m, _ = x.shape
    gram = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    outs: list[Tensor] = []
    for step, (a, b, c) in enumerate(schedule):
        symmetric_product(x, gram, None, 1.0, 0.0, configs["gram"])
        symmetric_product(gram, poly, gram, c, b, configs["poly"])
        if len(outs) < 2:  # two buffers in turn, laid out as the update writes them
            outs.append(update_output(x, configs["update"]))
        x = update_product(poly, x, outs[step % 2], a, configs["update"])
    return x if schedule else x.clone(memory_format=torch.contiguous_format)


def _kernels(x: Tensor, variant: str):
    return load(NEWTON_SCHULZ, NEWTON_SCHULZ.variant(dtype=TRITON_DTYPES[x.dtype], variant=variant))


def _impl(config: Mapping, x: Tensor, product: str) -> str:
    impl = config["impl"]
    return "classic" if impl == "hopper" and not hopper_fits(x, config, product) else impl


def _launch(config: Mapping) -> dict:
    return dict(num_warps=config["num_warps"], num_stages=config["num_stages"])


def symmetric_product(x: Tensor, out: Tensor, c: Tensor | None, alpha: float, beta: float, config: Mapping) -> None:
    """out = alpha X Xᵀ (+ beta C): x (B, m, k) any strides (the Gram product, k = n) or the
    symmetric (B, m, m) gram (the poly product, with C := gram: c A Aᵀ + b A); out and C
    contiguous (B, m, m)."""
    product = "gram" if c is None else "poly"
    impl = _impl(config, x, product)
    if impl == "torch" and c is None:
        torch.bmm(x, x.mT, out=out)
        return
    if impl == "torch":
        torch.baddbmm(c, x, x.mT, beta=beta, alpha=alpha, out=out)
        return
    kernels = _kernels(x, impl)
    batch, m, k = x.shape
    c = out if c is None else c  # not read without HAS_C
    block, block_k = config["BLOCK"], config["BLOCK_K"]
    tiles = -(-m // block) * (-(-m // block) + 1) // 2
    shapes = dict(HAS_C=product == "poly", BLOCK=block, BLOCK_K=block_k, **_launch(config))
    if impl == "classic":
        kernels.sym_kernel[(tiles, batch)](x, c, out, m, k, *x.stride(), *c.stride(), *out.stride(), alpha, beta,
                                           **shapes)  # fmt: skip
        return
    from triton.tools.tensor_descriptor import TensorDescriptor  # host-built TMA descriptors

    tall = _transposed(x)
    s = x.mT if tall else x.contiguous()  # the storage: (B, k, m) if tall else (B, m, k)
    x_desc = TensorDescriptor.from_tensor(s.reshape(-1, s.shape[-1]), [block_k, block] if tall else [block, block_k])
    out_desc, c_desc = (TensorDescriptor.from_tensor(t, [1, block, block]) for t in (out, c))  # clipped per matrix
    sms = _sm_count(x)
    kernels.sym_kernel[(min(sms, batch * tiles),)](x_desc, out_desc, c_desc, batch, m, k, alpha, beta, TRANS_X=tall,
                                                   GROUP_M=config["GROUP_M"], NUM_SMS=sms, **shapes)  # fmt: skip


def update_output(x: Tensor, config: Mapping) -> Tensor:
    """An empty result of ``update_product`` for x (B, m, n): contiguous, or for the hopper kernel
    on a transposed x, the transposed view of a contiguous (B, n, m) tensor."""
    if _impl(config, x, "update") == "hopper" and _transposed(x):
        return torch.empty(x.mT.shape, dtype=x.dtype, device=x.device).mT
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def update_product(poly: Tensor, x: Tensor, out: Tensor, a: float, config: Mapping) -> Tensor:
    """out = a X + Bm X: poly Bm (B, m, m) contiguous and symmetric, x (B, m, n) any strides, out
    from ``update_output``. Returns out."""
    impl = _impl(config, x, "update")
    if impl == "torch":
        return torch.baddbmm(x, poly, x, beta=a, out=out)
    kernels = _kernels(x, impl)
    batch, m, n = x.shape
    block, block_n, block_k = config["BLOCK"], config["BLOCK_N"], config["BLOCK_K"]
    shapes = dict(BLOCK=block, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config["GROUP_M"], **_launch(config))
    if impl == "classic":
        grid = (-(-m // block) * -(-n // block_n), batch)
        kernels.update_kernel[grid](poly, x, out, m, n, *poly.stride(), *x.stride(), *out.stride(), a, **shapes)
        return out
    from triton.tools.tensor_descriptor import TensorDescriptor

    # Wide: out = a X + Bm X. Tall, in X's storage S = Xᵀ (B, n, m): outᵀ = a S + S Bm (Bm symmetric).
    tall = _transposed(x)
    s, o = (x.mT, out.mT) if tall else (x.contiguous(), out)
    if not o.is_contiguous():
        raise RuntimeError("update_product: the hopper kernel writes a contiguous result in x's storage layout "
                           "(use update_output)")  # fmt: skip
    rows, cols = s.shape[1:]
    flat, gram = s.reshape(batch * rows, cols), poly.view(batch * m, m)
    left, right = (flat, gram) if tall else (gram, flat)
    sms = _sm_count(x)
    grid = (min(sms, batch * -(-rows // block) * -(-cols // block_n)),)
    kernels.update_kernel[grid](TensorDescriptor.from_tensor(left, [block, block_k]),
                                TensorDescriptor.from_tensor(right, [block_k, block_n]), s, o, batch, m, rows, cols, a,
                                NUM_SMS=sms, **shapes)  # fmt: skip
    return out


def _sm_count(x: Tensor) -> int:
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


def _transposed(x: Tensor) -> bool:
    """Whether x (B, m, n) is the transposed view of a contiguous (B, n, m) tensor (a tall matrix)."""
    return not x.is_contiguous() and x.mT.is_contiguous()


def hopper_fits(x: Tensor, config: Mapping, product: str) -> bool:
    """Whether the hopper kernel of ``product`` takes x (B, m, n) (the Gram product's X, the poly
    product's gram, the update's X): a GPU with TMA (sm90 and up) or the interpreter; rows of
    16-byte multiples and, where x is read in place, a 16-byte aligned start (TMA's rules); and, in
    a batch, a contraction dimension that ends at a matrix's edge where it runs along the
    descriptor's rows, since a TMA block reads on into the next matrix: m for the update, n for
    the Gram product of a transposed x (along a row, TMA fills zeros past the end)."""
    batch, m, n = x.shape
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif not interpreter_enabled():
        return False
    align = 16 // x.element_size()
    tall = _transposed(x)
    in_place = x.is_contiguous() or tall  # else the launcher reads a contiguous copy
    if m % align or n % align or (in_place and x.data_ptr() % 16):
        return False
    block_k = config["BLOCK_K"]
    along_rows = {"gram": n if tall else 0, "poly": 0, "update": m}[product]
    return batch == 1 or along_rows % block_k == 0


# Small batches are bound by the host issuing 3 launches per iteration (about 25 µs each with
# triton 3.6, more than the GPU needs at 1024^2): they replay a CUDA graph of the iterations.
GRAPH_MAX_NUMEL = 1 << 22
_GRAPH_CACHE_SIZE = 16
_graphs: OrderedDict[tuple, _GraphedIterations] = OrderedDict()  # least recently used first


class StaticGraph:
    """A CUDA graph of ``run(x)`` on one static CUDA tensor x, read in place at every replay: the
    caller writes x's values, then ``replay()``. ``run`` is compiled and warmed up on a side stream
    before the capture. The result lives in the graph's memory pool and is overwritten by the next
    replay, so it is consumed on the replaying stream before that."""

    def __init__(self, x: Tensor, run: Callable[[Tensor], Tensor]) -> None:
        self.input = x
        with torch.cuda.device(x.device):  # the capture runs on the input's device
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                run(x)
            torch.cuda.current_stream(x.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = run(x)

    def replay(self) -> Tensor:
        self.graph.replay()
        return self.output


class _GraphedIterations:
    """``triton_newton_schulz`` for one (shape, dtype, device, schedule, config) through a
    ``StaticGraph``: inputs are copied into its static buffer, results copied out of it."""

    def __init__(self, x: Tensor, schedule: list[tuple[float, float, float]], config: Mapping) -> None:
        buffer = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        buffer.copy_(x)
        self.graph = StaticGraph(buffer, lambda inp: triton_newton_schulz(inp, schedule, config))

    def __call__(self, x: Tensor) -> Tensor:
        self.graph.input.copy_(x)
        return self.graph.replay().clone()


def graphed_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]], config: Mapping) -> Tensor:
    """``triton_newton_schulz`` through a cached CUDA graph when x is a small CUDA batch and no
    graph is being captured (then, or for large batches, it launches directly)."""
    if not x.is_cuda or x.numel() > GRAPH_MAX_NUMEL or torch.cuda.is_current_stream_capturing():
        return triton_newton_schulz(x, schedule, config)
    configs = per_product(config)
    key = (tuple(x.shape), x.dtype, x.device, tuple(schedule),
           tuple((p, tuple(sorted(configs[p].items()))) for p in PRODUCTS))  # fmt: skip
    graphed = _graphs.get(key)
    if graphed is None:
        while len(_graphs) >= _GRAPH_CACHE_SIZE:
            _graphs.popitem(last=False)
        graphed = _graphs[key] = _GraphedIterations(x, schedule, config)
    _graphs.move_to_end(key)
    return graphed(x)
