"""Launches of the Triton Newton–Schulz kernels (kernel_templates/newton_schulz.py.j2)."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from kernel_factory.generator import (
    NEWTON_SCHULZ,
    NEWTON_SCHULZ_STREAM_K,
    detect_arch,
    interpreter_enabled,
    load,
    select,
    size_bucket,
)

from ..shared import precompile

TRITON_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}

# Collecting (``collect_launches``): the launches are recorded instead of issued, on meta-device
# stand-ins of the batches (shapes and strides, no memory) for the CUDA device in ``device``.
_collecting = threading.local()


def _issue(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    launches = getattr(_collecting, "launches", None)
    if launches is None:
        kernel[grid](*args, **kwargs)
    else:
        launches.append((kernel, grid, args, kwargs))


def _device(x: Tensor) -> torch.device:
    """x's device, or for a meta stand-in being collected, the CUDA device it stands for."""
    return _collecting.device if x.is_meta and getattr(_collecting, "launches", None) is not None else x.device


def collect_launches(xs: list[Tensor], schedule: list[tuple[float, float, float]], norms: list[Tensor] | None,
                     config: Mapping | None = None) -> tuple[list[tuple], list[tuple]]:  # fmt: skip
    """The Triton launches ``joint_newton_schulz(xs, schedule, config, norms)`` issues, found without
    running anything or allocating its workspace (for precompile.py: the tensors in them are
    meta-device stand-ins), each (kernel, grid, args, kwargs): (the launches with every pair of
    hopper parts launched one by one, as a process's first steps issue them; the two-part launches
    that later steps take in their place, ``_launch_pair``)."""
    meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
    _collecting.launches, _collecting.paired, _collecting.device = [], [], xs[0].device
    try:
        joint_newton_schulz([meta(x) for x in xs], schedule, config, None if norms is None else list(map(meta, norms)))
        return _collecting.launches, _collecting.paired
    finally:
        _collecting.launches = _collecting.paired = None


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


def side_class(m: int) -> int:
    """The cache's shape key of a batch (B, m, n), m <= n (the family's ``side`` axis): m as the
    next power of two, clamped to the axis's 1024..8192."""
    sides = NEWTON_SCHULZ.axes["side"]
    return min(max(size_bucket(m), sides[0]), sides[-1])


def ns_config(x: Tensor) -> dict[str, Mapping]:
    """The tuned config of each product (``PRODUCTS``) for x ((m, n) or (B, m, n), m <= n): by its
    dtype, short side and work (the family default on CPU)."""
    device = _device(x)
    arch = "cpu" if device.type == "cpu" else detect_arch(device)
    dtype = TRITON_DTYPES[x.dtype]
    # Keyed by the work of the whole batch, which tells the batches of Muon apart: the elements
    # alone do not (36 of 768 x 2048 is as many as one 8192^2), and how many tiles a tile size
    # gives matters as much as the matrix size (one 1024^2 wants small tiles, 48 of 768^2 large);
    # and by the short side, which sets the Gram product's tiles and their length (side_class).
    # Each product has its own config: at 48 x 768^2 the Gram product runs fastest on the
    # classic kernels and the update on the hopper ones (H200).
    work = iteration_flops(*x.shape) if x.dim() == 3 else iteration_flops(1, *x.shape)
    side = side_class(x.shape[-2])
    return {product: select(NEWTON_SCHULZ, arch, NEWTON_SCHULZ.variant(dtype=dtype, product=product, side=side),
                            dtype, work)
            for product in PRODUCTS}  # fmt: skip


def _work(x: Tensor) -> int:
    return iteration_flops(*x.shape)


def normalized(x: Tensor, norm: Tensor) -> Tensor:
    """x[b] / norm[b] rounded to x's dtype, as torch's NS divides its bf16 input by the norm:
    x (B, m, n), norm (B,) fp32 holding values of x's dtype (Muon's norms are bf16 values: torch's
    bf16 vector_norm, ``norm_kernel``). The quotient is formed in fp32 and rounded once, the bits
    of ``x.float() / norm`` rounded to x's dtype; dividing by the norm cast to x's dtype (exact)
    keeps it one elementwise launch of x's dtype, without the fp32 copies in between or a
    mixed-dtype launch (three launches, or one at a third of the copy rate, on an H200)."""
    return x / norm.to(x.dtype)[:, None, None]


def joint_newton_schulz(xs: list[Tensor], schedule: list[tuple[float, float, float]], config: Mapping | None = None,
                        norms: list[Tensor] | None = None) -> list[Tensor]:  # fmt: skip
    """The iterations of ``schedule`` on each batch x (B, m, n), m <= n, bf16 or fp32 (the
    interpreter's), any strides (a transposed tall matrix); not written. The batches' products run
    in the same launches where the hopper kernels take them (two batches a launch), so one batch's
    tiles fill the SMs another's last wave leaves idle.

    ``norms``: None (x is normalized already) or one (B,) fp32 tensor per batch, x[b] standing for
    x[b] / norm[b]: the first iteration's products scale by it (SCALED), its update on the Triton
    kernels where the tuned one is torch's (``scaled_update_config``), or where its Gram product
    is torch's, x is divided first (``normalized``). ``config``: one newton_schulz
    config or one per product (``per_product``), by default the tuned ones of the batch with the
    most work; each product's ``impl`` picks its kernels: "classic", "hopper" where ``hopper_fits``
    (else the classic ones with the same tiles) or "torch" (torch's batched matmuls). Returns one
    new (B, m, n) tensor of x's dtype per batch: contiguous, or where the update runs the hopper
    kernel or torch's matmul on a transposed x, the transposed view of a contiguous (B, n, m) one."""
    for x in xs:
        if x.dtype not in TRITON_DTYPES or x.dim() != 3 or x.shape[1] > x.shape[2]:
            raise ValueError(f"the Newton-Schulz kernels take (B, m, n), m <= n, bf16 or fp32; got "
                             f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    configs = per_product(config or ns_config(max(xs, key=_work)))
    first_update = configs["update"]
    if norms is not None and (not schedule or configs["gram"]["impl"] == "torch"):
        xs, norms = [normalized(x, n) for x, n in zip(xs, norms, strict=True)], None
    elif norms is not None and first_update["impl"] == "torch":
        first_update = scaled_update_config(first_update)
    grams = [torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype, device=x.device) for x in xs]
    polys = [torch.empty_like(g) for g in grams]
    outs: list[list[Tensor]] = []  # two buffers in turn, laid out as the update writes them
    own_first = first_update is not configs["update"]  # its output may be laid out otherwise: its own buffers
    for step, (a, b, c) in enumerate(schedule):
        scale = norms if step == 0 else None
        symmetric_product(xs, grams, None, 1.0, 0.0, configs["gram"], scale)
        # Bm = c A A + b A + a I, so that the update is Bm X alone (the template says why).
        symmetric_product(grams, polys, grams, c, b, configs["poly"], gamma=a)
        if step == 0 and own_first:
            xs = update_product(polys, xs, [update_output(x, first_update) for x in xs], first_update, scale)
            continue
        turn = step - own_first
        if len(outs) < 2:
            outs.append([update_output(x, configs["update"]) for x in xs])
        xs = update_product(polys, xs, outs[turn % 2], configs["update"], scale)
    return xs if schedule else [x.clone(memory_format=torch.contiguous_format) for x in xs]


def scaled_update_config(config: Mapping) -> dict:
    """The first update's config where the tuned one is torch's matmuls and x comes unnormalized
    (``norms``): the hopper kernels (the classic ones where they do not fit) with the config's
    tiles (a torch config carries the family default's), which scale by the norm as they go.
    torch's matmuls would need x divided first, one more pass over the batch (a broadcast
    division, far from the copy rate), which the tuner leaves out: it times each product on
    normalized inputs. In the owners' NS of a 123M model's sharded Muon step (2 H200s) the
    divisions took 81 µs of the 2.0 ms step; at that key the family default's tiles timed 18 µs
    slower than cuBLAS's update (the entry's ``default_p50_ms`` against its ``p50_ms``)."""
    return {**config, "impl": "hopper"}


def triton_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]],
                         config: Mapping | None = None) -> Tensor:  # fmt: skip
    """``joint_newton_schulz`` of one normalized batch x (B, m, n), m <= n."""
    return joint_newton_schulz([x], schedule, config)[0]


def _kernels(x: Tensor, variant: str):
    return load(NEWTON_SCHULZ, NEWTON_SCHULZ.variant(dtype=TRITON_DTYPES[x.dtype], variant=variant))


def _impl(config: Mapping, x: Tensor, product: str) -> str:
    """The kernels ``config`` runs ``product`` on for x: its ``impl``, the hopper ones for a
    stream-K update (there is no such kernel), the classic ones where the hopper ones do not fit."""
    impl = config["impl"]
    if impl == "stream_k" and product == "update":
        impl = "hopper"
    return "classic" if impl in ("hopper", "stream_k") and not hopper_fits(x, config, product) else impl


def _launch(config: Mapping) -> dict:
    return dict(num_warps=config["num_warps"], num_stages=config["num_stages"])


def _hopper_pairs(parts: list[tuple], contraction: Callable[[tuple], int]) -> list[tuple[tuple, tuple | None]]:
    """The parts of the hopper launches, two a launch, the longer contraction first in each (its
    tiles take longest: dealt first, the other part's fill the last wave)."""
    parts = sorted(parts, key=contraction, reverse=True)
    return [(parts[i], parts[i + 1] if i + 1 < len(parts) else None) for i in range(0, len(parts), 2)]


_UNPAIRED: set[tuple] = set()  # (kernel, config) whose two-part build exceeded shared memory


def _launch_pair(kernel: str, config: Mapping, first: tuple, second: tuple | None, launch: Callable) -> None:
    """``launch(first, second)``: one two-part launch, or one launch per part where the two-part
    kernel of this config does not fit in shared memory (its second tile loop may need buffers of
    its own) or is still compiling in the background (``precompile.ready``): a process's first
    steps take the one-part variants, which compute each tile as the two-part one does and compile
    in half the time. Collecting, both: the parts' launches as the first steps issue them, the
    pair's in ``_collecting.paired`` (queued for compiles after the rest)."""
    key = (kernel, tuple(sorted(config.items())))
    if second is not None and key not in _UNPAIRED:
        from triton.runtime.errors import OutOfResources

        collected = getattr(_collecting, "launches", None)
        pair = _recorded(lambda: launch(first, second))
        if collected is not None:
            _collecting.paired.append(pair)
        elif precompile.ready(pair[0], pair[2], pair[3]):
            try:
                _issue(*pair)
                return
            except OutOfResources:
                _UNPAIRED.add(key)
                warnings.warn(f"kernel_factory: the two-batch {kernel} kernel does not fit in shared memory "
                              f"with {dict(config)}; its batches launch one by one", RuntimeWarning,
                              stacklevel=3)  # fmt: skip
    launch(first, None)
    if second is not None:
        launch(second, None)


def _recorded(launch: Callable[[], None]) -> tuple:
    """The (kernel, grid, args, kwargs) that ``launch()`` issues (exactly one), recorded, not run."""
    outer = getattr(_collecting, "launches", None)
    _collecting.launches = []
    try:
        launch()
        (recorded,) = _collecting.launches
        return recorded
    finally:
        _collecting.launches = outer


def symmetric_product(xs: list[Tensor], outs: list[Tensor], cs: list[Tensor] | None, alpha: float, beta: float,
                      config: Mapping, norms: list[Tensor] | None = None, gamma: float = 0.0) -> None:  # fmt: skip
    """out = alpha X Xᵀ for each batch x (B, m, k), any strides (the Gram product, k = n), or
    out = alpha X Xᵀ + beta C + gamma I for the symmetric (B, m, m) gram (the poly product, with
    C := gram: c A Aᵀ + b A + a I); out and C contiguous (B, m, m). ``norms``: X[b] stands for
    X[b] / norm[b] (classic and hopper kernels)."""
    product = "gram" if cs is None else "poly"
    parts = list(zip(xs, outs, cs or outs, norms or [None] * len(xs), strict=True))  # C: not read without HAS_C
    hopper = []
    for x, out, c, norm in parts:
        impl = _impl(config, x, product)
        if impl in ("hopper", "stream_k"):
            hopper.append((x, out, c, norm))
        elif impl == "torch" and norm is not None:
            raise ValueError("symmetric_product: torch's matmuls take a normalized x (no norm)")
        elif impl == "torch" and product == "gram":
            torch.bmm(x, x.mT, out=out)
        elif impl == "torch":
            torch.baddbmm(c, x, x.mT, beta=beta, alpha=alpha, out=out)
            out.diagonal(dim1=-2, dim2=-1).add_(gamma)
        else:
            _classic_symmetric(x, out, c, norm, alpha, beta, gamma, product == "poly", config)
    # Stream-K where the launch holds one batch (a joint launch's second part fills the first's
    # last wave already); the choice depends on the batches alone, so every step rounds alike.
    if len(hopper) == 1 and config["impl"] == "stream_k" and _stream_symmetric(*hopper[0], alpha, beta, gamma,
                                                                               product == "poly", config):
        return
    for first, second in _hopper_pairs(hopper, lambda part: part[0].shape[2]):
        _launch_pair("sym", config, first, second,
                     lambda one, two: _hopper_symmetric(one, two, alpha, beta, gamma, product == "poly", config))


def _classic_symmetric(x, out, c, norm, alpha, beta, gamma, has_c: bool, config: Mapping) -> None:
    batch, m, k = x.shape
    block = config["BLOCK"]
    tiles = -(-m // block) * (-(-m // block) + 1) // 2
    _issue(_kernels(x, "classic").sym_kernel, (tiles, batch),
           (x, c, out, out if norm is None else norm, m, k, *x.stride(), *c.stride(), *out.stride(), alpha, beta,
            gamma),
           dict(HAS_C=has_c, SCALED=norm is not None, BLOCK=block, BLOCK_K=config["BLOCK_K"], **_launch(config)))


def _symmetric_part(x, out, c, norm, config: Mapping) -> tuple[tuple, bool]:
    """The hopper symmetric kernels' arguments for one part (x_desc, out_desc, c_desc, norm, B, m,
    k) and whether x is a transposed tall matrix (TRANS_X)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # host-built TMA descriptors

    block, block_k = config["BLOCK"], config["BLOCK_K"]
    tall = _transposed(x)
    s = x.mT if tall else x.contiguous()  # the storage: (B, k, m) if tall else (B, m, k)
    x_block = [block_k, block] if tall else [block, block_k]
    x_desc = TensorDescriptor.from_tensor(s.reshape(-1, s.shape[-1]), x_block)
    out_desc, c_desc = (TensorDescriptor.from_tensor(t, [1, block, block]) for t in (out, c))  # clipped per matrix
    return (x_desc, out_desc, c_desc, out if norm is None else norm, *x.shape), tall


def _hopper_symmetric(first: tuple, second: tuple | None, alpha, beta, gamma, has_c: bool, config: Mapping) -> None:
    block, block_k = config["BLOCK"], config["BLOCK_K"]
    parts = [_symmetric_part(*p, config) for p in (first, second) if p is not None]
    (args, tall), (args2, tall2) = parts[0], parts[-1]  # the second is not read without TWO_PARTS
    x = first[0]
    tiles = sum(a[4] * (-(-a[5] // block)) * (-(-a[5] // block) + 1) // 2 for a, _ in parts)
    sms = _sm_count(x)
    _issue(_kernels(x, "hopper").sym_kernel, (min(sms, tiles),), (*args, *args2, alpha, beta, gamma),
           dict(HAS_C=has_c, SCALED=first[3] is not None, TRANS_X=tall, TRANS_X2=tall2, TWO_PARTS=second is not None,
                BLOCK=block, BLOCK_K=block_k, GROUP_M=config["GROUP_M"], NUM_SMS=sms, **_launch(config)))


# The stream-K kernel's workspace per (device, BLOCK, programs): a partial fp32 tile and a flag
# per program (newton_schulz_stream_k.py.j2), the flags zero between launches. Kept for the
# process (CUDA graphs hold its address) and shared by the device's launches, which therefore
# must not run at the same time on two streams.
_STREAM_WORKSPACES: dict[tuple, tuple[Tensor, Tensor]] = {}
_WORKSPACE_LOCK = threading.Lock()


def _stream_workspace(x: Tensor, block: int, programs: int) -> tuple[Tensor, Tensor] | None:
    """(partials (programs, block, block) fp32, flags (programs,) int32) for x's device; None
    while a CUDA graph is being captured and none was made yet (one made then would live in the
    graph's memory pool)."""
    if x.is_meta:
        return (torch.empty(programs, block, block, dtype=torch.float32, device="meta"),
                torch.empty(programs, dtype=torch.int32, device="meta"))  # fmt: skip
    key = (x.device, block, programs)
    with _WORKSPACE_LOCK:
        workspace = _STREAM_WORKSPACES.get(key)
        if workspace is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            workspace = _STREAM_WORKSPACES[key] = (
                torch.empty(programs, block, block, dtype=torch.float32, device=x.device),
                torch.zeros(programs, dtype=torch.int32, device=x.device))  # fmt: skip
        return workspace


def _stream_symmetric(x, out, c, norm, alpha, beta, gamma, has_c: bool, config: Mapping) -> bool:
    """The stream-K symmetric product of one batch, one program per SM; False (nothing launched)
    where its workspace cannot be made now (``_stream_workspace``)."""
    programs = _sm_count(x)
    workspace = _stream_workspace(x, config["BLOCK"], programs)
    if workspace is None:
        return False
    (x_desc, out_desc, c_desc, norm_arg, batch, m, k), tall = _symmetric_part(x, out, c, norm, config)
    stream_k = NEWTON_SCHULZ_STREAM_K
    kernel = load(stream_k, stream_k.variant(dtype=TRITON_DTYPES[x.dtype])).sym_stream_kernel
    _issue(kernel, (programs,), (x_desc, out_desc, c_desc, norm_arg, *workspace, batch, m, k, alpha, beta, gamma),
           dict(HAS_C=has_c, SCALED=norm is not None, TRANS_X=tall, BLOCK=config["BLOCK"], BLOCK_K=config["BLOCK_K"],
                GROUP_M=config["GROUP_M"], NUM_PROGRAMS=programs, **_launch(config)))
    return True


def update_output(x: Tensor, config: Mapping) -> Tensor:
    """An empty result of ``update_product`` for x (B, m, n): contiguous, or for the hopper kernel
    or torch's matmul on a transposed x, the transposed view of a contiguous (B, n, m) tensor (O
    in x's layout: a tall matrix's rows stay contiguous)."""
    if _impl(config, x, "update") in ("hopper", "torch") and _transposed(x):
        return torch.empty(x.mT.shape, dtype=x.dtype, device=x.device).mT
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def update_product(polys: list[Tensor], xs: list[Tensor], outs: list[Tensor], config: Mapping,
                   norms: list[Tensor] | None = None) -> list[Tensor]:  # fmt: skip
    """out = Bm X for each batch: poly Bm (B, m, m) contiguous and symmetric, x (B, m, n) any
    strides, out from ``update_output``. ``norms``: X[b] stands for X[b] / norm[b] (Bm comes from
    the scaled Gram matrix; classic and hopper kernels). Returns outs."""
    hopper = []
    for poly, x, out, norm in zip(polys, xs, outs, norms or [None] * len(xs), strict=True):
        impl = _impl(config, x, "update")
        if impl == "hopper":
            hopper.append((poly, x, out, norm))
        elif impl == "torch" and norm is not None:
            raise ValueError("update_product: torch's matmuls take a normalized x (no norm)")
        elif impl == "torch" and _transposed(x) and out.mT.is_contiguous():
            torch.bmm(x.mT, poly.mT, out=out.mT)  # (Bm X)ᵀ = Xᵀ Bmᵀ, written in x's storage layout
        elif impl == "torch":
            torch.bmm(poly, x, out=out)
        else:
            _classic_update(poly, x, out, norm, config)
    for first, second in _hopper_pairs(hopper, lambda part: part[1].shape[1]):
        _launch_pair("update", config, first, second, lambda one, two: _hopper_update(one, two, config))
    return outs


def _classic_update(poly, x, out, norm, config: Mapping) -> None:
    batch, m, n = x.shape
    block, block_n = config["BLOCK"], config["BLOCK_N"]
    grid = (-(-m // block) * -(-n // block_n), batch)
    _issue(_kernels(x, "classic").update_kernel, grid,
           (poly, x, out, out if norm is None else norm, m, n, *poly.stride(), *x.stride(), *out.stride()),
           dict(SCALED=norm is not None, BLOCK=block, BLOCK_N=block_n, BLOCK_K=config["BLOCK_K"],
                GROUP_M=config["GROUP_M"], **_launch(config)))


def _hopper_update(first: tuple, second: tuple | None, config: Mapping) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    block, block_n, block_k = config["BLOCK"], config["BLOCK_N"], config["BLOCK_K"]

    def part(poly, x, out, norm):
        # Wide: out = Bm X. Tall, in X's storage S = Xᵀ (B, n, m): outᵀ = S Bm (Bm symmetric).
        batch, m, _ = x.shape
        tall = _transposed(x)
        s, o = (x.mT, out.mT) if tall else (x.contiguous(), out)
        if not o.is_contiguous():
            raise RuntimeError("update_product: the hopper kernel writes a contiguous result in x's storage layout "
                               "(use update_output)")  # fmt: skip
        rows, cols = s.shape[1:]
        flat, gram = s.reshape(batch * rows, cols), poly.view(batch * m, m)
        left, right = (flat, gram) if tall else (gram, flat)
        return (TensorDescriptor.from_tensor(left, [block, block_k]),
                TensorDescriptor.from_tensor(right, [block_k, block_n]), o, out if norm is None else norm, batch, m,
                rows, cols)  # fmt: skip

    parts = [part(*p) for p in (first, second) if p is not None]  # parts[-1] is not read without TWO_PARTS
    x = first[1]
    tiles = sum(p[4] * -(-p[6] // block) * -(-p[7] // block_n) for p in parts)
    sms = _sm_count(x)
    _issue(_kernels(x, "hopper").update_kernel, (min(sms, tiles),), (*parts[0], *parts[-1]),
           dict(SCALED=first[3] is not None, TWO_PARTS=second is not None, NUM_SMS=sms, BLOCK=block, BLOCK_N=block_n,
                BLOCK_K=block_k, GROUP_M=config["GROUP_M"], **_launch(config)))


def _sm_count(x: Tensor) -> int:
    device = _device(x)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


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
    device = _device(x)
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
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
# Up to 2^24 elements: on an H100, NS5 on one 2048 x 8192 matrix took 1.8-2.3 ms launched from
# Python and 1.21 ms replayed (torch's matmuls 1.40-1.49); at 4096^2 both took 2.1-2.2 ms.
GRAPH_MAX_NUMEL = 1 << 24
_GRAPH_CACHE_SIZE = 16
# The graphs' inputs together stay within 256 MB (each graph's pool holds a few times its input:
# the iterates, the Gram and poly matrices): eight 2048 x 8192 graphs, sixteen of 2^22 elements.
_GRAPH_CACHE_BYTES = 1 << 28
_graphs: OrderedDict[tuple, _GraphedIterations] = OrderedDict()  # least recently used first


class StaticGraph:
    """A CUDA graph of ``run()`` on ``device``: ``run`` reads static CUDA tensors in place at every
    replay, so the caller writes their values, then ``replay()``. ``run`` is compiled and warmed up
    on a side stream before the capture. The result lives in the graph's memory pool and is
    overwritten by the next replay, so it is consumed on the replaying stream before that."""

    def __init__(self, device: torch.device, run: Callable[[], object]) -> None:
        with torch.cuda.device(device):  # the capture runs on the inputs' device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = run()

    def replay(self):
        self.graph.replay()
        return self.output


class _GraphedIterations:
    """``triton_newton_schulz`` for one (shape, dtype, device, schedule, config) through a
    ``StaticGraph``: inputs are copied into its static buffer, results copied out of it."""

    def __init__(self, x: Tensor, schedule: list[tuple[float, float, float]], config: Mapping) -> None:
        self.input = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.input.copy_(x)
        self.graph = StaticGraph(x.device, lambda: triton_newton_schulz(self.input, schedule, config))

    def __call__(self, x: Tensor) -> Tensor:
        self.input.copy_(x)
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
        cached_bytes = sum(g.input.nbytes for g in _graphs.values())
        while _graphs and (len(_graphs) >= _GRAPH_CACHE_SIZE or cached_bytes + x.nbytes > _GRAPH_CACHE_BYTES):
            cached_bytes -= _graphs.popitem(last=False)[1].input.nbytes
        graphed = _graphs[key] = _GraphedIterations(x, schedule, config)
    _graphs.move_to_end(key)
    return graphed(x)
