"""Adam-mini on FSDP2's sharded parameters: block statistics across shards, PyTorch ops on the
local rows.

FSDP2 splits a parameter's dim 0 (``torch.chunk``), so a rank holds whole rows of its matrix view
(rows = shape[0]) or, for a 1-D parameter (one row), a run of that row's elements. A block (a
head's rows, a row, the whole tensor) can span ranks, so its mean of g² is formed in two steps:
each rank adds g² over its part of every block, one all-reduce per shard group (the mesh dim
that splits the rows; HSDP's replicas hold copies) sums all parameters' partial sums at once,
and the sum is divided by the block's size. The second moments of blocks are then the same on
every rank: a ``Replicate`` DTensor of shape [blocks], whatever the world size, so DCP reshards
it exactly. Where every row is a block (kind ``row``: V, attention output, MLP, embeddings), a
rank holds its blocks whole: their second moments are an [R] DTensor split like the rows, formed
with no collective. Plain Adam's (biases) is elementwise, a DTensor like the param, as is the
momentum.

On CUDA (and under the interpreter with the ``triton`` backend) the local rows step through the
fused kernel (``sharded_plan.py``); elsewhere the math is the reference step's (``reference.py``)
in PyTorch ops. Either way only the order of the block sums differs from one process's (fp32,
about log2(n) ulps of the mean).

FP8 momentum (``fp8.py``'s layout) shards with the rows: the E4M3 codes are a DTensor like the
param, the per-sub-block scales a DTensor of global shape [R, ceil(C / sub_block)] split like the
rows (sub-blocks never cross rows), so both reshard exactly. The bf16 fallback pool is left out:
its slots are handed out per parameter in row order, which would make it depend on the world
size; a sub-block that would fall back stays FP8 and counts as an overflow (``overflow_total``).
A sharded vector (one row, split across sub-blocks) keeps bf16 momentum.

Other layouts (tensor parallelism's column split ``Shard(1)``, FSDP2 + TP's 2-D layouts) hold
parts of rows: every block's sum of g² is then all-reduced over each mesh dim that splits the
param, the second moments are replicated ``[blocks]`` even where rows are blocks, the momentum is
bf16 (FP8 sub-blocks would cross a column split) and the step runs PyTorch ops.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ..shared.dtensor import local_row_indices, row_shard_group, split_groups
from .fp8 import dequantize, fp8_layout, quantize_
from .partition import ParamPartition


def rows_are_blocks(p: DTensor, part: ParamPartition) -> bool:
    """Whether every row of sharded ``p`` is a block (kind ``row``, a matrix) and its rows are split
    on one mesh dim alone (``row_shard_group``): then each rank holds its blocks whole and keeps
    their second moments, sharded like the rows, with no collective."""
    return part.kind == "row" and p.dim() >= 2 and row_shard_group(p) is not None


def block_sums_span_ranks(p: DTensor, part: ParamPartition) -> bool:
    """Whether sharded ``p``'s rows alone are split (``row_shard_group``) and its blocks are not
    rows nor elements: a block may then span ranks, and each rank's sum of g² over its part of it
    goes into a ``ShardSums`` slot (the optimizer's ``_block_sums``)."""
    return part.kind != "adam" and not rows_are_blocks(p, part) and row_shard_group(p) is not None


def second_moment_zeros(p: DTensor, part: ParamPartition) -> DTensor:
    """Zero second moments of sharded ``p``: per element like ``p`` (plain Adam); per row [R] split
    like the rows (``rows_are_blocks``); else per block, [blocks] replicated on ``p``'s mesh."""
    if part.kind == "adam":
        return torch.zeros_like(p, dtype=torch.float32)
    device = p.to_local().device
    if rows_are_blocks(p, part):
        local = torch.zeros(p.to_local().shape[0], dtype=torch.float32, device=device)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=(part.rows,), stride=(1,))
    local = torch.zeros(part.blocks, dtype=torch.float32, device=device)
    return DTensor.from_local(local, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)


def sharded_fp8_state(p: DTensor, part: ParamPartition, sub_block: int) -> dict[str, DTensor]:
    """Zero FP8 momentum of a sharded matrix: codes like ``p``, scales [R, per row] split like its rows."""
    per_row = fp8_layout(part.rows, part.cols, sub_block, 1.0)[0]
    rows_here = p.to_local().shape[0]
    scale = torch.zeros((rows_here, per_row), dtype=torch.float32, device=p.to_local().device)
    return {
        "exp_avg": torch.zeros_like(p, dtype=torch.float8_e4m3fn),
        "exp_avg_scale": DTensor.from_local(scale, p.device_mesh, p.placements, run_check=False,
                                            shape=(part.rows, per_row), stride=(per_row, 1)),  # fmt: skip
    }


def local_state_view(state: dict, sub_block: int, device) -> dict[str, Tensor]:
    """A sharded param's state with local tensors (``step`` as it is), as one process keeps it:
    FP8 momentum with a bf16 pool of 0 slots, as ``fp8.quantize_`` / ``dequantize`` and the kernel
    take it."""
    view = {key: state[key].to_local() for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale") if key in state}
    view["step"] = state["step"]
    if "exp_avg_scale" in state:
        view["exp_avg_pool"] = torch.empty((2, 0, sub_block), dtype=torch.bfloat16, device=device)
        view["exp_avg_pool_used"] = torch.zeros(2, dtype=torch.int32, device=device)
    return view


class ShardedParam:
    """One DTensor parameter's local rows and their blocks (``sub_block``: its FP8 sub-block size).
    Any placements: where columns are split too (tensor parallelism), each local row is part of
    its row, and the sums over blocks are all-reduced over every mesh dim that splits ``p``."""

    def __init__(self, p: DTensor, part: ParamPartition, sub_block: int) -> None:
        self.p, self.part, self.sub_block = p, part, sub_block
        self.groups = split_groups(p)  # a block's sum of g² is all-reduced over each in turn
        self.rows_split = row_shard_group(p) is not None  # whole rows here, split on one mesh dim
        self.local = p.to_local()
        self.vector = p.dim() < 2  # one row: the local elements are part of it
        rows = ([0] if self.local.numel() else []) if self.vector else local_row_indices(p).tolist()
        bounds = part.block_rows()
        block_of_row = torch.bucketize(torch.arange(part.rows), torch.tensor(bounds[1:]), right=True)
        self.block_ids_host = block_of_row[rows].tolist()  # the block of each local row
        self.block_ids = torch.tensor(self.block_ids_host, dtype=torch.int64, device=self.local.device)
        self.rows_local = rows_are_blocks(p, part)
        # where each local row's second moment sits in the local second-moment tensor
        self.v_index = torch.arange(len(rows), device=self.local.device) if self.rows_local else self.block_ids
        self.block_numel = part.block_numel().to(self.local.device)  # elements per block, whole

    def rows_view(self, t: Tensor) -> Tensor:
        """A local tensor as (local rows, row elements here)."""
        return t.view(1, -1) if self.vector else t.view(t.shape[0], -1)

    def partial_sq_sums(self, g: Tensor, out: Tensor | None = None) -> Tensor:
        """Σ g² over this rank's part of each block: fp32 [blocks], added into ``out`` where given."""
        if out is None:
            out = torch.zeros(self.part.blocks, dtype=torch.float32, device=self.local.device)
        if self.local.numel():
            g = self.rows_view(g).float()
            out.index_add_(0, self.block_ids, (g * g).sum(dim=1))
        return out


def row_mean_sq(item: ShardedParam, g: Tensor) -> Tensor:
    """Mean g² of each local row of a param whose rows are blocks (``rows_are_blocks``): [rows here]."""
    return (item.rows_view(g).float() ** 2).mean(dim=1) if item.local.numel() else g.new_zeros(0).float()


def reduce_block_sums(sums: list[tuple[ShardedParam, Tensor]]) -> dict[int, Tensor]:
    """The blocks' mean g² of each (param, this rank's Σ g² over its part of each block [blocks]),
    by ``id`` of the ShardedParam: one all-reduce per split mesh dim carries every param's sums (call
    it once per step, for all param groups)."""
    pending: dict[tuple, list[int]] = {}
    for i, (item, _) in enumerate(sums):
        pending.setdefault(tuple(map(id, item.groups)), []).append(i)
    means = {}
    for members in pending.values():
        flat = torch.cat([sums[i][1] for i in members])
        for group in sums[members[0]][0].groups:
            dist.all_reduce(flat, group=group)
        flat /= torch.cat([sums[i][0].block_numel for i in members])
        for i, chunk in zip(members, flat.split([sums[i][1].numel() for i in members]), strict=True):
            means[id(sums[i][0])] = chunk
    return means


def sharded_adam_mini_step(items: list[ShardedParam], grads: list[Tensor], states: list[dict],
                           means: list[Tensor | None], *, lr: float, beta1: float, beta2: float, eps: float,
                           weight_decay: float) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """One Adam-mini step of one group's sharded params (``items``) with local ``grads`` and their
    blocks' ``means`` of g² (``row_mean_sq``, ``reduce_block_sums``; None for plain Adam); returns
    this rank's largest |update| (0-d fp32) and its FP8 overflows (0-d int64; None without FP8 momentum)."""
    amax = torch.zeros((), dtype=torch.float32, device=items[0].local.device)
    overflow = None
    for item, g, state, mean_sq in zip(items, grads, states, means, strict=True):
        a, o = _step_local(item, g, state, mean_sq, lr, beta1, beta2, eps, weight_decay)
        amax = torch.maximum(amax, a)
        if o is not None:
            overflow = o if overflow is None else overflow + o
    return amax, overflow


def _step_local(item: ShardedParam, grad: Tensor, state: dict, mean_sq: Tensor | None, lr, beta1, beta2, eps,
                weight_decay) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``reference.adam_mini_reference_step``'s math on the local rows, with the blocks' mean g²;
    returns (largest |update|, FP8 overflows or None)."""
    step = int(state["step"].item()) + 1
    state["step"].add_(1)
    fp8 = state["exp_avg"].dtype == torch.float8_e4m3fn
    device = item.local.device
    if not item.local.numel():
        if mean_sq is not None:  # the replicated second moments advance on every rank alike
            state["exp_avg_sq"].to_local().mul_(beta2).add_(mean_sq, alpha=1 - beta2)
        return torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device) if fp8 else None
    g = item.rows_view(grad).float()
    x = item.rows_view(item.local).float()
    if fp8:
        codes = local_state_view(state, item.sub_block, device)
        m_stored = None
        m_old = dequantize(codes, g.shape[0], g.shape[1], read_half=0)
    else:
        m_stored = item.rows_view(state["exp_avg"].to_local())
        m_old = m_stored.float()
    v = state["exp_avg_sq"].to_local()
    bc1, bc2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
    if item.part.kind == "adam":
        v = item.rows_view(v)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        v.mul_(beta2).add_(mean_sq, alpha=1 - beta2)
    if weight_decay > 0.0 and item.part.weight_decay:
        x.mul_(1 - lr * weight_decay)
    m = m_old.lerp_(g, 1 - beta1)
    if item.part.kind == "adam":
        h = (v.sqrt() / bc2_sqrt).add_(eps)
        x.addcdiv_(m, h, value=-lr / bc1)
        amax = (m / h).abs().max() * (lr / bc1)
    else:
        h = (v.sqrt() / bc2_sqrt).add_(eps)
        update = m * ((1 / bc1) / h)[item.v_index][:, None] * lr
        x.sub_(update)
        amax = update.abs().max()
    overflow = None
    if fp8:
        overflow = quantize_(codes, m, write_half=0)[1]
    else:
        m_stored.copy_(m)
    item.rows_view(item.local).copy_(x)
    return amax.float(), overflow

