"""How Muon's hidden matrices step: one batch per NS shape, each through the Triton kernels of
kernel_templates/muon.py.j2 or through torch's multi-tensor ops.

A batch holds the matrices of one group that share one (m, n), m <= n (tall ones transposed),
device and dtype. The Triton path reads g and the momentum buffer once and writes the buffer and
the bf16 NS input once (tall matrices transposed tile by tile) with the partial sums of its norm,
runs NS with the normalization folded into the first iteration's products, and reads p and O once
to write p: about 24 bytes per fp32 parameter moved outside NS, where torch's multi-tensor ops
move about 60 (and fall back to one launch per matrix for transposed views). The CUDA batches of a
group run their NS iterations together (newton_schulz_launch.joint_newton_schulz): two batches
share each launch, so neither leaves SMs idle in its last wave of tiles.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from kernel_factory.generator import MUON, backend_mode, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES, aligned, kernel_path, pointer_table
from ..shared.checks import checked_grads
from ..shared.dtensor import local
from ..shared.grad_table import GradTable
from .newton_schulz import coefficient_schedule, iterate
from .newton_schulz_launch import StaticGraph, collect_launches, joint_newton_schulz, normalized

# Replay a CUDA graph of a device's NS iterations (captured on the batches' static inputs at the
# first step) instead of issuing their launches from the host. On the H200, without the graphs
# the host took 1.6 to 3.2 ms to issue a 134M hidden-list step whose kernels ran 3.3 ms, and the
# GPU waited between launches; with them it takes 0.4 to 0.9 ms. The graph's memory pool keeps
# the iterations' workspace (2 Gram-sized and 2 X-sized bf16 buffers per batch) between steps.
GRAPH_NS = True
NORM_BLOCK = 1024  # partial sums the norm kernel adds per vector step


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for a rows x cols matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class MuonHyper:
    """One Muon group's hyperparameters for this step."""

    def __init__(self, group: dict) -> None:
        self.lr = float(group["lr"])
        self.weight_decay = float(group["weight_decay"])
        self.momentum = float(group["momentum"])
        self.nesterov = bool(group["nesterov"])
        self.adjust_lr_fn = group["adjust_lr_fn"]
        self.eps = float(group["eps"])
        self.eps_bf16 = _bf16_value(self.eps)  # the reference clamps a bf16 norm at eps rounded to bf16
        self.schedule = _schedule(group["ns_coefficients"], group["ns_steps"])


def on_device(device: torch.device):
    """The context that makes ``device`` current for Triton's launches (which go to the current
    CUDA device), or none for a CPU device or the current one (a device switch and back costs the
    host a few microseconds, taken about 20 times a sharded step)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# Formed every step from the group's values, which rarely change: memoized (a CPU tensor a step
# and the schedule's checks cost the host more than the rest of the group's hyperparameters).
@functools.lru_cache(maxsize=64)
def _bf16_value(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.bfloat16))


_schedules: dict[str, list[tuple[float, float, float]]] = {}


def _schedule(coefficients, steps) -> list[tuple[float, float, float]]:
    """``coefficient_schedule``, memoized where its arguments are plain Python values (keyed by
    their repr, which tells 1, 1.0 and True apart, so a bad value is refused every time)."""

    def plain(x) -> bool:
        return x is None or type(x) in (int, float, str) or (type(x) in (list, tuple) and all(map(plain, x)))

    if not (plain(coefficients) and plain(steps)):
        return coefficient_schedule(coefficients, steps)
    key = repr((coefficients, steps))
    if key not in _schedules:
        if len(_schedules) >= 64:
            _schedules.clear()
        _schedules[key] = coefficient_schedule(coefficients, steps)
    return list(_schedules[key])


class MuonBatch:
    """The matrices of one NS batch: params (any shape, viewed (shape[0], rest)) and their
    momentum buffers (params' shape and dtype)."""

    def __init__(self, params: list[Tensor], bufs: list[Tensor], m: int, n: int) -> None:
        self.params, self.bufs, self.m, self.n = params, bufs, m, n
        self.device, self.dtype = params[0].device, params[0].dtype
        self.transposed = [p.shape[0] != m for p in params]  # tall: stored (n, m)
        self._tall = torch.tensor(self.transposed).to(self.device)  # (B,) bool, for update_amax
        self._amax: Callable[[], Tensor] | None = None

    def grads(self) -> list[Tensor]:
        return checked_grads(self.params)

    def lrs(self, h: MuonHyper) -> tuple[float, float]:
        """The adjusted lr of a wide (m, n) and of a tall (n, m) matrix of this batch."""
        return adjusted_lr(h.lr, h.adjust_lr_fn, self.m, self.n), adjusted_lr(h.lr, h.adjust_lr_fn, self.n, self.m)

    def keep_update(self, h: MuonHyper, ortho: Tensor, static: bool) -> None:
        """Keep what ``update_amax`` needs of this step's O (B, m, n): O itself where it is a CUDA
        graph's static output (read when asked, no cost in the step), else its max |O| per matrix."""
        lr_wide, lr_tall = self.lrs(h)
        per_matrix = None if static else ortho.abs().amax(dim=(-2, -1))

        def amax() -> Tensor:
            o = ortho.abs().amax(dim=(-2, -1)) if per_matrix is None else per_matrix
            return (o.float() * torch.where(self._tall, lr_tall, lr_wide)).max()

        self._amax = amax

    def update_amax(self) -> Tensor:
        """The last step's largest |adjusted lr · O| over the batch (0-d fp32; weight decay left out)."""
        return self._amax() if self._amax is not None else torch.zeros((), device=self.device)

    def run(self, h: MuonHyper) -> None:
        raise NotImplementedError


class TorchBatch(MuonBatch):
    """torch's multi-tensor ops (CPU, non-contiguous tensors, KERNEL_FACTORY_BACKEND=torch)."""

    def run(self, h: MuonHyper) -> None:
        grads, bufs = self.grads(), self.bufs
        torch._foreach_lerp_(bufs, grads, 1 - h.momentum)
        updates = torch._foreach_lerp(grads, bufs, h.momentum) if h.nesterov else bufs
        wide = [u.reshape(u.shape[0], -1) for u in updates]
        wide = [u.mT if t else u for u, t in zip(wide, self.transposed, strict=True)]
        # NS starts by rounding to bf16: stack straight into a bf16 batch (one multi-tensor copy).
        x = torch.empty((len(wide), self.m, self.n), dtype=torch.bfloat16, device=self.device)
        torch._foreach_copy_(list(x.unbind(0)), wide)
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        ortho = iterate(x / norm.clamp(min=h.eps), h.schedule).to(self.dtype)  # p.add_ computes in p's dtype
        self.keep_update(h, ortho, static=False)
        torch._foreach_mul_(self.params, 1 - h.lr * h.weight_decay)
        lr_wide, lr_tall = self.lrs(h)
        for tall, step_lr in ((False, lr_wide), (True, lr_tall)):
            idx = [i for i, t in enumerate(self.transposed) if t == tall]
            if idx:
                steps = [(ortho[i].mT if tall else ortho[i]).reshape(self.params[i].shape) for i in idx]
                torch._foreach_add_([self.params[i] for i in idx], steps, alpha=-step_lr)


class TritonBatch(MuonBatch):
    """The kernels of kernel_templates/muon.py.j2 around NS: one launch each per batch (pointer
    tables), or per matrix where the interpreter runs them or a tensor is not 16-byte aligned."""

    def __init__(self, params, bufs, m, n, multi_tensor: bool) -> None:
        super().__init__(params, bufs, m, n)
        self.multi_tensor = multi_tensor
        arch = "cpu" if self.device.type == "cpu" else detect_arch(self.device)
        self._variant = dict(multi_tensor=multi_tensor, param_dtype=TRITON_DTYPES[self.dtype])
        self.config = dict(select(MUON, arch, MUON.variant(**self._variant), self._variant["param_dtype"],
                                  len(params) * m * n))  # fmt: skip
        self._kernels: dict[bool, object] = {}
        # NS's input, not normalized, and the norm that divides it (static: a CUDA graph reads them)
        self.x = torch.empty((len(params), m, n), dtype=torch.bfloat16, device=self.device)
        self.norm = torch.empty(len(params), dtype=torch.float32, device=self.device)
        self.flags = torch.tensor(self.transposed, dtype=torch.int32).to(self.device)
        if multi_tensor:
            self.p_table, self.buf_table = pointer_table(params, self.device), pointer_table(bufs, self.device)
            self._grads = GradTable(self.device, len(params))

    def configure(self, config) -> None:
        """Launch with ``config`` from now on (the tuner tries configs this way)."""
        self.config = dict(MUON.check_config(config))

    def kernels(self, nesterov: bool):
        k = self._kernels.get(nesterov)
        if k is None:
            k = self._kernels[nesterov] = load(MUON, MUON.variant(**self._variant, nesterov=nesterov))
        return k

    def _launch(self) -> tuple[int, dict]:
        blocks = dict(BLOCK_R=self.config["BLOCK_R"], BLOCK_C=self.config["BLOCK_C"])
        tiles = -(-self.m // blocks["BLOCK_R"]) * -(-self.n // blocks["BLOCK_C"])
        return tiles, dict(**blocks, num_warps=self.config["num_warps"])

    def prepare(self, h: MuonHyper) -> Tensor:
        """Update the momentum buffers, write NS's input X (B, m, n) bf16 and its norms (B,) fp32
        (``self.norm``); return X, which NS divides by the norms."""
        k = self.kernels(h.nesterov)
        m, n, batch = self.m, self.n, len(self.params)
        tiles, launch = self._launch()
        partial = torch.empty((batch, tiles), dtype=torch.float32, device=self.device)
        mu = h.momentum
        if self.multi_tensor:
            momentum, norm = self._multi_launches(h, self._grads.update(self.params, self.grads), partial)[:2]
            for kernel, grid, args, kwargs in (momentum, norm):
                kernel[grid](*args, **kwargs)
            return self.x
        for i, (g, buf) in enumerate(zip(self.grads(), self.bufs, strict=True)):
            k.momentum_kernel[(tiles,)](g.contiguous(), buf, int(self.transposed[i]), self.x[i], partial[i],
                                        m, n, mu, 1 - mu, **launch)  # fmt: skip
        k.norm_kernel[(batch,)](partial, self.norm, tiles, h.eps_bf16, BLOCK_T=NORM_BLOCK)
        return self.x

    def _multi_launches(self, h: MuonHyper, grad_table, partial, ortho=None) -> list[tuple]:
        """(kernel, grid, args, kwargs) of the multi-tensor launches around NS: the momentum update
        (writing X and the norm's partial sums ``partial`` (B, tiles) fp32), the norm, and the
        update of p from ``ortho`` (B, m, n) bf16."""
        k = self.kernels(h.nesterov)
        m, n, batch = self.m, self.n, len(self.params)
        tiles, launch = self._launch()
        mu, decay = h.momentum, 1 - h.lr * h.weight_decay
        return [(k.momentum_kernel, (tiles, batch),
                 (grad_table, self.buf_table, self.flags, self.x, partial, m, n, mu, 1 - mu), launch),
                (k.norm_kernel, (batch,), (partial, self.norm, tiles, h.eps_bf16), dict(BLOCK_T=NORM_BLOCK)),
                (k.apply_kernel, (tiles, batch), (self.p_table, self.flags, ortho, m, n, decay, *self.lrs(h)),
                 launch)]  # fmt: skip

    def ahead_launches(self, h: MuonHyper) -> list[tuple]:
        """The launches around NS with placeholders (dtypes for tensors made at the step), for
        precompile.py; none for the per-matrix launches."""
        return self._multi_launches(h, self._grads.table, torch.float32, torch.bfloat16) if self.multi_tensor else []

    def apply(self, h: MuonHyper, ortho: Tensor) -> None:
        """p = p (1 - lr wd) - adjusted lr * O, O (B, m, n) bf16 contiguous, tall matrices transposed."""
        if self.multi_tensor:
            kernel, grid, args, kwargs = self._multi_launches(h, None, None, ortho)[2]
            kernel[grid](*args, **kwargs)
            return
        k = self.kernels(h.nesterov)
        m, n = self.m, self.n
        tiles, launch = self._launch()
        decay = 1 - h.lr * h.weight_decay
        lr_wide, lr_tall = self.lrs(h)
        for i, p in enumerate(self.params):
            k.apply_kernel[(tiles,)](p, int(self.transposed[i]), ortho[i], m, n, decay, lr_wide, lr_tall,
                                     **launch)  # fmt: skip

    def run(self, h: MuonHyper) -> None:
        """The batch alone (CPU, the interpreter): NS through ``iterate`` on the normalized X."""
        self.prepare(h)
        ortho = iterate(normalized(self.x, self.norm), h.schedule).contiguous()
        self.keep_update(h, ortho, static=False)
        self.apply(h, ortho)



class JointNS:
    """The NS iterations of one device's Triton batches, run together (``joint_newton_schulz``) on
    their static inputs (X and norm), through a CUDA graph replay (``GRAPH_NS``) where no capture
    is under way, captured again when the coefficient schedule changes and once the two-part
    kernels compiling in the background are all ready (until then the graph holds one launch per
    part: ``newton_schulz_launch._launch_pair``)."""

    def __init__(self, batches: list[TritonBatch]) -> None:
        self.batches = batches
        self._graph: tuple[tuple, StaticGraph] | None = None  # ((schedule, pairs pending), its graph)

    def ahead_launches(self, schedule: list[tuple[float, float, float]]) -> tuple[list[tuple], list[tuple]]:
        """The iterations' launches (nothing run), for precompile.py: (those of the first steps,
        the two-part ones that later steps take in their place)."""
        return collect_launches([b.x for b in self.batches], schedule, [b.norm for b in self.batches])

    def __call__(self, schedule: list[tuple[float, float, float]]) -> tuple[list[Tensor], bool]:
        """Each batch's O, and whether they are static (a graph's outputs, rewritten by its
        replays: a graph of this class, or one the caller is capturing)."""
        run = lambda: self._run(schedule)  # noqa: E731
        if torch.cuda.is_current_stream_capturing():
            return run(), True
        if not GRAPH_NS:
            return run(), False
        key = (tuple(schedule), precompile.optional_pending(), *self._key())
        if self._graph is None or self._graph[0] != key:
            self._graph = (key, StaticGraph(self.batches[0].device, run))
        return self._graph[1].replay(), True

    def _run(self, schedule: list[tuple[float, float, float]]) -> list[Tensor]:
        """What the graph holds: the iterations of every batch."""
        return joint_newton_schulz([b.x for b in self.batches], schedule, norms=[b.norm for b in self.batches])

    def _key(self) -> tuple:
        """What else the graph bakes in (a subclass's constants), beside the schedule."""
        return ()


def _batch_kind(ps: list[Tensor], bufs: list[Tensor], mode: str) -> Callable[..., MuonBatch]:
    paths = {kernel_path(p, mode) for p in ps}  # the buffers are contiguous (init_momentum_buffer)
    if paths == {"interpreter"}:
        return lambda *a: TritonBatch(*a, multi_tensor=False)
    if paths == {"cuda"}:
        return lambda *a: TritonBatch(*a, multi_tensor=aligned([*ps, *bufs]))
    return TorchBatch


def init_momentum_buffer(p: Tensor, state: dict) -> None:
    """Create (or, after a checkpoint load, normalise) ``p``'s momentum buffer: like ``p`` (a DTensor
    with its placements for a DTensor param), contiguous and 16-byte aligned locally."""
    buf = state.get("momentum_buffer")
    shard = local(buf) if buf is not None else None
    if buf is None:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    elif (buf.dtype != p.dtype or shard.device != local(p).device or not shard.is_contiguous()
          or shard.data_ptr() % 16):  # fmt: skip
        # Loaded from a checkpoint as a view or in another dtype: the kernels take contiguous,
        # 16-byte aligned buffers of the param's dtype.
        state["momentum_buffer"] = buf.to(p.device, p.dtype, memory_format=torch.contiguous_format, copy=True)


def init_muon_group_state(group: dict, state: dict) -> None:
    """Create the momentum buffers of a Muon group's parameters up front (those that require grad,
    are not empty and not on the meta device)."""
    for p in group["params"]:
        if p.requires_grad and p.numel() and not p.is_meta:
            init_momentum_buffer(p, state[p])


class MuonGroupPlan:
    """The batches of one Muon param group, built from the params that have grads."""

    def __init__(self, key: tuple, params: list[Tensor], state: dict, backend: str | None = None) -> None:
        self.key = key
        mode = backend or backend_mode()
        groups: dict[tuple, list[Tensor]] = {}
        for i, p in enumerate(params):
            if p.is_complex():  # torch.optim.Muon's error
                raise RuntimeError(f"Muon does not support complex parameters (parameter {i}, shape {tuple(p.shape)})")
            if p.numel() == 0:
                continue  # nothing to orthogonalize or update
            init_momentum_buffer(p, state[p])
            rows, cols = p.shape[0], p.numel() // max(p.shape[0], 1)
            groups.setdefault((min(rows, cols), max(rows, cols), p.device, p.dtype), []).append(p)
        self.batches: list[MuonBatch] = []
        for (m, n, _, _), ps in groups.items():
            bufs = [state[p]["momentum_buffer"] for p in ps]
            self.batches.append(_batch_kind(ps, bufs, mode)(ps, bufs, m, n))
        joint: dict[torch.device, list[TritonBatch]] = {}
        for batch in self.batches:
            if isinstance(batch, TritonBatch) and batch.device.type == "cuda":
                joint.setdefault(batch.device, []).append(batch)
        self.joint = [JointNS(batches) for batches in joint.values()]
        self._warm: list[precompile.Warm] = []  # kernels compiling in the background
        self._queued = False  # precompile() has run (once a plan: a constructor may call it twice)

    def precompile(self, group: dict) -> None:
        """Queue the Triton variants ``run(group)`` will launch for their background compile (once)."""
        if self._queued:
            return
        self._queued = True
        h = MuonHyper(group)
        for ns in self.joint:
            device = ns.batches[0].device
            if precompile.enabled(device):
                first_steps, pairs = ns.ahead_launches(h.schedule)
                launches = [la for b in ns.batches for la in b.ahead_launches(h)] + first_steps
                self._warm += precompile.warm_launches(launches, device)
                precompile.warm_optional(pairs, device)  # not waited for: ready when ready

    def run(self, group: dict) -> None:
        precompile.wait_all(self._warm)
        h = MuonHyper(group)
        for batch in self.batches:
            if not (isinstance(batch, TritonBatch) and batch.device.type == "cuda"):
                batch.run(h)
        for ns in self.joint:
            with on_device(ns.batches[0].device):
                for batch in ns.batches:
                    batch.prepare(h)
                orthos, static = ns(h.schedule)
                for batch, ortho in zip(ns.batches, orthos, strict=True):
                    batch.keep_update(h, ortho, static)
                    batch.apply(h, ortho.contiguous())

    def update_amax(self) -> Tensor:
        """The last step's largest |adjusted lr · O| over the group's batches (0-d fp32)."""
        if not self.batches:
            return torch.zeros(())
        device = self.batches[0].device
        return torch.stack([b.update_amax().to(device) for b in self.batches]).max()


def muon_group_plan(plans: dict[int, MuonGroupPlan], index: int, params: list[Tensor], state: dict,
                    backend: str | None = None) -> MuonGroupPlan:  # fmt: skip
    """The cached plan of Muon param group ``index``, rebuilt when the params with grads change."""
    key = tuple(map(id, params))
    plan = plans.get(index)
    if plan is None or plan.key != key:
        plan = plans[index] = MuonGroupPlan(key, params, state, backend)
    return plan
