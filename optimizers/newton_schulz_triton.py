"""Launches of the Triton Newton–Schulz kernels (kernel_templates/newton_schulz.py.j2)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import Tensor

from kernel_factory.generator import NEWTON_SCHULZ, detect_arch, interpreter_enabled, load, select

TRITON_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def iteration_flops(batch: int, m: int, n: int) -> int:
    """FLOPs of one NS iteration on (batch, m, n), m <= n, with full products: X Xᵀ and B X
    (2 m² n each) and A A (2 m³). The tuned cache's size key for this family."""
    return batch * (4 * m * m * n + 2 * m**3)


def ns_config(x: Tensor) -> Mapping[str, int]:
    """The tuned config for x ((m, n) or (B, m, n), m <= n): by its dtype and work (the family
    default on CPU)."""
    arch = "cpu" if x.device.type == "cpu" else detect_arch(x.device)
    dtype = TRITON_DTYPES[x.dtype]
    # Keyed by the work of the whole batch, which tells the batches of Muon apart: the elements
    # alone do not (36 of 768 x 2048 is as many as one 8192^2), and how many tiles a tile size
    # gives matters as much as the matrix size (one 1024^2 wants small tiles, 48 of 768^2 large).
    work = iteration_flops(*x.shape) if x.dim() == 3 else iteration_flops(1, *x.shape)
    return select(NEWTON_SCHULZ, arch, NEWTON_SCHULZ.variant(dtype=dtype), dtype, work)


def triton_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]],
                         config: Mapping[str, int] | None = None) -> Tensor:  # fmt: skip
    """The iterations of ``schedule`` on x (B, m, n), m <= n, already normalized; x may be any
    strided view (a transposed tall matrix) and is not written. bf16 or fp32 (the interpreter's).
    ``config["impl"]`` picks the kernels: "classic", or "hopper" where ``hopper_fits`` (else the
    classic ones with the same tiles). Returns a new (B, m, n) tensor of x's dtype: contiguous, or
    for a transposed x on the hopper path the transposed view of a contiguous (B, n, m) one."""
    if x.dtype not in TRITON_DTYPES or x.dim() != 3 or x.shape[1] > x.shape[2]:
        raise ValueError(f"triton_newton_schulz takes (B, m, n), m <= n, bf16 or fp32; got {tuple(x.shape)} {x.dtype}")
    config = dict(config or ns_config(x))
    if config["impl"] == "hopper" and hopper_fits(x, config):
        return _hopper_iterations(x, schedule, config)
    return _classic_iterations(x, schedule, config)


def _kernels(x: Tensor, variant: str):
    return load(NEWTON_SCHULZ, NEWTON_SCHULZ.variant(dtype=TRITON_DTYPES[x.dtype], variant=variant))


def _classic_iterations(x: Tensor, schedule, config: Mapping[str, int]) -> Tensor:
    kernels = _kernels(x, "classic")
    batch, m, n = x.shape
    gram = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    outs = [torch.empty(batch, m, n, dtype=x.dtype, device=x.device) for _ in range(min(2, len(schedule)))]
    block, block_n, block_k = config["BLOCK"], config["BLOCK_N"], config["BLOCK_K"]
    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    tiles = -(-m // block)
    sym_grid = (tiles * (tiles + 1) // 2, batch)
    update_grid = (tiles * -(-n // block_n), batch)
    for step, (a, b, c) in enumerate(schedule):
        out = outs[step % 2]
        kernels.sym_kernel[sym_grid](x, gram, gram, m, n, *x.stride(), *gram.stride(), *gram.stride(), 1.0, 0.0,
                                     HAS_C=False, BLOCK=block, BLOCK_K=block_k, **launch)  # fmt: skip
        kernels.sym_kernel[sym_grid](gram, gram, poly, m, m, *gram.stride(), *gram.stride(), *poly.stride(), c, b,
                                     HAS_C=True, BLOCK=block, BLOCK_K=block_k, **launch)  # fmt: skip
        kernels.update_kernel[update_grid](poly, x, out, m, n, *poly.stride(), *x.stride(), *out.stride(), a,
                                           BLOCK=block, BLOCK_N=block_n, BLOCK_K=block_k,
                                           GROUP_M=config["GROUP_M"], **launch)  # fmt: skip
        x = out
    return x if schedule else x.contiguous()


def _transposed(x: Tensor) -> bool:
    """Whether x (B, m, n) is the transposed view of a contiguous (B, n, m) tensor (a tall matrix)."""
    return not x.is_contiguous() and x.mT.is_contiguous()


def hopper_fits(x: Tensor, config: Mapping[str, int]) -> bool:
    """Whether the hopper kernels take x (B, m, n): a GPU with TMA (sm90 and up) or the
    interpreter; rows of 16-byte multiples and, where x is read in place, a 16-byte aligned start
    (TMA's rules); and, in a batch, contraction dimensions that end at a matrix's edge, since a
    TMA block reads on into the next matrix: m (the update's) and, for a transposed x, n (its Gram
    matrix's) multiples of BLOCK_K."""
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
    return batch == 1 or (m % block_k == 0 and (not tall or n % block_k == 0))


def _hopper_iterations(x: Tensor, schedule, config: Mapping[str, int]) -> Tensor:
    """The hopper kernels; a transposed x stays in its storage's layout S = Xᵀ (B, n, m) throughout."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # host-built TMA descriptors

    kernels = _kernels(x, "hopper")
    batch, m, n = x.shape
    tall = _transposed(x)
    s = x.mT if tall else x.contiguous()  # the storage: (B, n, m) if tall else (B, m, n)
    block, block_n, block_k = config["BLOCK"], config["BLOCK_N"], config["BLOCK_K"]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    common = dict(GROUP_M=config["GROUP_M"], NUM_SMS=sms, num_warps=config["num_warps"],
                  num_stages=config["num_stages"])  # fmt: skip
    gram = torch.empty(batch * m, m, dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    outs = [torch.empty_like(s) for _ in range(min(2, len(schedule)))]
    tiles = -(-m // block)
    sym_grid = (min(sms, batch * tiles * (tiles + 1) // 2),)
    rows, cols = s.shape[1:]
    update_grid = (min(sms, batch * -(-rows // block) * -(-cols // block_n)),)
    gram_in = TensorDescriptor.from_tensor(gram, [block, block_k])
    gram_out = TensorDescriptor.from_tensor(gram, [block, block])
    poly_out = TensorDescriptor.from_tensor(poly, [block, block])
    for step, (a, b, c) in enumerate(schedule):
        out = outs[step % 2]
        flat = s.reshape(batch * rows, cols)
        x_in = TensorDescriptor.from_tensor(flat, [block_k, block] if tall else [block, block_k])
        kernels.sym_kernel[sym_grid](x_in, gram_out, gram, gram, batch, m, n, 1.0, 0.0, HAS_C=False, TRANS_X=tall,
                                     BLOCK=block, BLOCK_K=block_k, **common)  # fmt: skip
        kernels.sym_kernel[sym_grid](gram_in, poly_out, gram, poly, batch, m, m, c, b, HAS_C=True, TRANS_X=False,
                                     BLOCK=block, BLOCK_K=block_k, **common)  # fmt: skip
        # out = a X + Bm X; tall: its storage Sᵀ's is a S + S Bm (Bm symmetric)
        left, right = (flat, poly) if tall else (poly, flat)
        kernels.update_kernel[update_grid](TensorDescriptor.from_tensor(left, [block, block_k]),
                                           TensorDescriptor.from_tensor(right, [block_k, block_n]), s, out, batch,
                                           m, rows, cols, a, BLOCK=block, BLOCK_N=block_n, BLOCK_K=block_k,
                                           **common)  # fmt: skip
        s = out
    if not schedule:
        s = s.clone()
    return s.mT if tall else s


# Small batches are bound by the host issuing 3 launches per iteration (about 25 µs each with
# triton 3.6, more than the GPU needs at 1024^2): they replay a CUDA graph of the iterations.
GRAPH_MAX_NUMEL = 1 << 22
_GRAPH_CACHE_SIZE = 16
_graphs: OrderedDict[tuple, _GraphedIterations] = OrderedDict()  # least recently used first


class _GraphedIterations:
    """A CUDA graph of ``triton_newton_schulz`` for one (shape, dtype, device, schedule, config);
    inputs are copied into its static buffer, results copied out of it."""

    def __init__(self, x: Tensor, schedule: list[tuple[float, float, float]], config: Mapping[str, int]) -> None:
        self.input = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.input.copy_(x)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # compiles and warms up outside the capture
            triton_newton_schulz(self.input, schedule, config)
        torch.cuda.current_stream(x.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = triton_newton_schulz(self.input, schedule, config)

    def __call__(self, x: Tensor) -> Tensor:
        self.input.copy_(x)
        self.graph.replay()
        return self.output.clone()


def graphed_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]],
                          config: Mapping[str, int]) -> Tensor:  # fmt: skip
    """``triton_newton_schulz`` through a cached CUDA graph when x is a small CUDA batch and no
    graph is being captured (then, or for large batches, it launches directly)."""
    if not x.is_cuda or x.numel() > GRAPH_MAX_NUMEL or torch.cuda.is_current_stream_capturing():
        return triton_newton_schulz(x, schedule, config)
    key = (tuple(x.shape), x.dtype, x.device, tuple(schedule), tuple(sorted(config.items())))
    graphed = _graphs.get(key)
    if graphed is None:
        while len(_graphs) >= _GRAPH_CACHE_SIZE:
            _graphs.popitem(last=False)
        with torch.cuda.device(x.device):  # the capture runs on the input's device
            graphed = _graphs[key] = _GraphedIterations(x, schedule, config)
    _graphs.move_to_end(key)
    return graphed(x)
