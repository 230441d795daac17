"""Muon on FSDP2's sharded matrices: an owner rank per matrix, two all-to-alls per batch.

Newton–Schulz needs whole matrices; FSDP2 holds each rank's rows (``torch.chunk`` on dim 0). A
batch is one group's DTensor matrices of one full shape, dtype and shard group (the mesh dim
their rows are split on; replicated mesh dims, as in HSDP, hold copies and exchange among
themselves). Per step:

1. each rank updates the momentum of its rows (elementwise, the buffer a DTensor like the param)
   and rounds NS's input to bf16, as single-process Muon does before NS;
2. an all-to-all sends every matrix's rows to its owner (matrix j belongs to rank j mod W),
   padded to ``ceil(R / W)`` rows per rank; the owner drops the padding rows, so NS sees exactly
   the single-process matrix (padding could flip the tall/wide choice);
3. the owner runs NS once on its matrices (normalization and iterations as single-process Muon);
4. a second all-to-all returns each rank's rows of O, and each rank applies weight decay and the
   update to its rows.

Every matrix is orthogonalized once per step on its fully reduced gradient, by the same arithmetic
as in one process, so the result does not depend on the world size; the traffic is about twice
the batch in bf16, where gathering every matrix everywhere moves W/2 times more and repeats NS on
every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard

from ..shared.checks import checked_grads
from ..shared.dtensor import DTensor, local
from .newton_schulz import iterate
from .plan import MuonHyper, adjusted_lr, init_momentum_buffer


def shard_group(p: DTensor):
    """(process group, world, rank) of the mesh dim that splits ``p``'s rows; TypeError for other
    layouts (a split of columns, as tensor parallelism's Shard(1), is not taken yet)."""
    sharded = [i for i, pl in enumerate(p.placements) if not pl.is_replicate()]
    rows_split = len(sharded) == 1 and type(p.placements[sharded[0]]) is Shard and p.placements[sharded[0]].dim == 0
    if not rows_split:
        raise TypeError(f"Muon takes DTensor matrices whose rows are split on one mesh dim (FSDP2, HSDP); "
                        f"a parameter of shape {tuple(p.shape)} has placements {p.placements}")  # fmt: skip
    mesh, dim = p.device_mesh, sharded[0]
    return mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)


class ShardedMuonBatch:
    """Same-shape DTensor matrices of one group, dtype and shard group (module docstring)."""

    def __init__(self, params: list[DTensor], bufs: list[DTensor]) -> None:
        self.params, self.bufs = params, bufs
        self.group, self.world, self.rank = shard_group(params[0])
        self.rows = params[0].shape[0]
        self.cols = math.prod(params[0].shape[1:])
        self.per_rank = -(-self.rows // self.world)
        self.local_params = [local(p) for p in params]
        self.local_bufs = [local(b) for b in bufs]
        self.slots = -(-len(params) // self.world)  # matrices each rank owns, at most
        self.owned = list(range(self.rank, len(params), self.world))
        self.device = self.local_params[0].device
        self.dtype = params[0].dtype
        self.tall = self.rows > self.cols
        self._amax = torch.zeros((), device=self.device)

    def _chunk(self, r: int) -> tuple[int, int]:
        start = min(r * self.per_rank, self.rows)
        return start, min(start + self.per_rank, self.rows)

    def run(self, h: MuonHyper) -> None:
        W, S, P, C = self.world, self.slots, self.per_rank, self.cols
        grads = checked_grads(self.params)
        torch._foreach_lerp_(self.local_bufs, grads, 1 - h.momentum)
        updates = torch._foreach_lerp(grads, self.local_bufs, h.momentum) if h.nesterov else self.local_bufs
        # 1-2. my rows of matrix j = owner + slot * W go to piece [owner, slot]; NS's input is bf16
        send = torch.zeros((W, S, P, C), dtype=torch.bfloat16, device=self.device)
        for j, u in enumerate(updates):
            send[j % W, j // W, : u.shape[0]].copy_(u.reshape(u.shape[0], C))
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)
        # 3. the owner's matrices, padding rows dropped: piece s holds rank s's rows
        full = got.permute(1, 0, 2, 3).reshape(S, W * P, C)[: len(self.owned), : self.rows]
        x = (full.mT if self.tall else full).contiguous()  # laid out as single-process Muon's batch
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
        ortho = iterate(x / norm.clamp(min=h.eps), h.schedule) if len(self.owned) else x
        ortho = ortho.mT if self.tall else ortho
        # 4. rows back to their ranks: piece r of the reply holds rank r's rows of my matrices
        reply = torch.zeros_like(send)
        padded = torch.zeros((len(self.owned), W * P, C), dtype=torch.bfloat16, device=self.device)
        padded[:, : self.rows] = ortho
        reply[:, : len(self.owned)] = padded.view(len(self.owned), W, P, C).permute(1, 0, 2, 3)
        back = torch.empty_like(reply)
        dist.all_to_all_single(back, reply, group=self.group)
        step_lr = adjusted_lr(h.lr, h.adjust_lr_fn, self.rows, self.cols)
        torch._foreach_mul_(self.local_params, 1 - h.lr * h.weight_decay)
        rows = self._chunk(self.rank)[1] - self._chunk(self.rank)[0]
        mine = [back[j % W, j // W, :rows].to(self.dtype).view_as(p) for j, p in enumerate(self.local_params)]
        torch._foreach_add_(self.local_params, mine, alpha=-step_lr)
        self._amax = back.abs().amax().float() * step_lr  # this rank's rows

    def update_amax(self) -> Tensor:
        """This rank's rows' largest |adjusted lr · O| of the last step (0-d fp32)."""
        return self._amax


class ShardedMuonGroupPlan:
    """The sharded batches of one Muon group's DTensor params with grads."""

    def __init__(self, key: tuple, params: list[DTensor], state: dict) -> None:
        self.key = key
        batches: dict[tuple, list[DTensor]] = {}
        for p in params:
            if p.is_complex():  # torch.optim.Muon's error
                raise RuntimeError(f"Muon does not support complex parameters (shape {tuple(p.shape)})")
            group = shard_group(p)[0]
            init_momentum_buffer(p, state[p])
            batches.setdefault((tuple(p.shape), p.dtype, local(p).device, id(group)), []).append(p)
        self.batches = [ShardedMuonBatch(ps, [state[p]["momentum_buffer"] for p in ps]) for ps in batches.values()]

    def run(self, group: dict) -> None:
        h = MuonHyper(group)
        for batch in self.batches:
            batch.run(h)

    def update_amax(self) -> Tensor:
        if not self.batches:
            return torch.zeros(())
        device = self.batches[0].device
        return torch.stack([b.update_amax().to(device) for b in self.batches]).max()


def sharded_muon_group_plan(plans: dict, index: int, params: list[DTensor], state: dict) -> ShardedMuonGroupPlan:
    """The cached sharded plan of Muon group ``index``, rebuilt when the params with grads change."""
    key = tuple(map(id, params))
    plan = plans.get(("sharded", index))
    if plan is None or plan.key != key:
        plan = plans[("sharded", index)] = ShardedMuonGroupPlan(key, params, state)
    return plan
