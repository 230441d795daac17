"""Adafactor on FSDP2's sharded parameters (dim 0 split on one mesh dim: ``row_shard_group``).

States keep global shapes that do not depend on the world size (DISTRIBUTED.md, rule 4), so DCP
reshards them: a matrix's ``row_var`` [R, 1] is split like its rows and its ``col_var`` [1, C] is
replicated; a tensor of 3+ dims split on dim 0 holds whole matrices, so both its statistics are
split like it; a vector's ``variance`` like the vector. They are kept in the param dtype, as torch
keeps them (``state_bits=32``): the 8-bit codes' blocks of 128 rows would straddle the shards,
and the statistics are (R + C) / (R C) of the parameters anyway.

A step of the sharded params takes two all-reduces per shard group, for all of them at once
(``shared.shard_sums``): (1) the column sums of g² of the split matrices and the sums of their new
row statistics (their mean over all rows); (2) every param's sums of u² (RMS of the update) and
p² (RMS(p)). Every rank then advances the same replicated column EMA. Matrices and vectors step
on the fused kernels (``plan.py``, ``split_rows``) where those take them, the rest here, in
PyTorch ops (``ShardedSteps``), both writing into the same slots. The first moment (``beta1``) is
split like the param; int8 codes and their per-row block scales where the rows are split
(momentum.py), bf16 for a vector.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..shared.dtensor import DTensor, Replicate, local, row_shard_group, split_like
from ..shared.shard_sums import ShardSums
from . import momentum


def shardable(p: Tensor) -> bool:
    """Whether the sharded path takes ``p``: a DTensor whose dim 0 alone is split (FSDP2, HSDP)."""
    return isinstance(p, DTensor) and row_shard_group(p) is not None


def sharded_statistics(p: DTensor) -> dict[str, DTensor]:
    """Zero second-moment statistics of ``p`` under torch.optim.Adafactor's names, in its dtype."""
    mine = local(p)
    zeros = lambda shape: torch.zeros(shape, dtype=p.dtype, device=mine.device)  # noqa: E731
    if p.dim() == 1:
        return {"variance": split_like(p, zeros(mine.shape), tuple(p.shape))}
    row = split_like(p, zeros((*mine.shape[:-1], 1)), (*p.shape[:-1], 1))
    if p.dim() == 2:  # rows split: every rank needs all columns' statistic
        col = DTensor.from_local(zeros((1, p.shape[-1])), p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                 run_check=False)  # fmt: skip
    else:  # dim 0 indexes whole matrices
        col = split_like(p, zeros((*mine.shape[:-2], 1, p.shape[-1])), (*p.shape[:-2], 1, p.shape[-1]))
    return {"row_var": row, "col_var": col}


def shard_slots(params: list[DTensor]) -> tuple[list[tuple[DTensor, int]], list[tuple[DTensor, int]]]:
    """The ``ShardSums`` slots of sharded ``params`` (the same list on every rank): red1, for a
    matrix's Σ row_next and its columns' Σ g² (1 + cols); red2, for every param's Σ u² and Σ p² (2)."""
    return [(p, 1 + p.shape[-1]) for p in params if p.dim() == 2], [(p, 2) for p in params]


def _lerp_(state: Tensor, target: Tensor, w: Tensor) -> None:
    """state = lerp(state, target, w) in fp32, rounded once to state's dtype, as torch's lerp with a
    Python weight computes it; ``w`` a 0-d fp32 tensor on state's device (a tensor weight of a
    half-precision lerp would be rounded to its dtype first)."""
    state.copy_(state.float().lerp_(target.float(), w))


class ShardedSteps:
    """One Adafactor step of sharded ``params`` on PyTorch ops (local ``grads``: unscaled, negated
    under ``maximize``) with ``group``'s hyperparameters, in three phases around the shard group's
    sums, ``red1`` and ``red2`` (``shard_slots``; the optimizer adds them over the ranks between the
    phases, for these params and the fused launches' at once). No host sync: step counts, RMS(p)
    and RMS(u) stay on the device (each state's ``step`` lives there)."""

    def __init__(self, params: list[DTensor], grads: list[Tensor], states: list[dict], group: dict, lr: float,
                 eps1: float, eps2: float, red1: ShardSums, red2: ShardSums) -> None:  # fmt: skip
        self.params, self.grads, self.states, self.group = params, grads, states, group
        self.lr, self.eps1, self.eps2, self.red1, self.red2 = lr, eps1, eps2, red1, red2
        self.weights: list[Tensor] = []
        self.updates: list[Tensor] = []

    def local_sums(self) -> None:
        """Phase 1: step counts, the statistics of this rank's rows, and into the slots this rank's
        Σ p², and a matrix's Σ row_next and column sums of g²."""
        for p, g, s in zip(self.params, self.grads, self.states, strict=True):
            s["step"] += 1
            w = s["step"].pow(self.group["beta2_decay"])  # 1 - beta2_t
            self.weights.append(w)
            self.red2[p][1] = local(p).float().square().sum()
            if p.dim() >= 2:
                row, col = local(s["row_var"]), local(s["col_var"])
                _lerp_(row, torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), w)
                if p.dim() == 2:  # the columns' sums of g² and the rows' sum of the statistic span the ranks
                    self.red1[p][0] = row.float().sum()
                    self.red1[p][1:] = g.float().square().sum(dim=-2)
                else:  # dim 0 indexes whole matrices
                    _lerp_(col, torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)), w)
            else:
                _lerp_(local(s["variance"]), g * g, w)

    def norms(self) -> None:
        """Phase 2 (red1 added over the ranks): a matrix's column statistic and the rows' mean, the
        updates u, and this rank's Σ u² into the slots."""
        for p, g, s, w in zip(self.params, self.grads, self.states, self.weights, strict=True):
            if p.dim() >= 2:
                row, col = local(s["row_var"]), local(s["col_var"])
                if p.dim() == 2:
                    _lerp_(col, (self.red1[p][1:] / p.shape[0]).view(col.shape).to(col.dtype), w)
                    mean = (self.red1[p][0] / p.shape[0]).to(row.dtype).clamp_(min=self.eps1)
                else:
                    mean = row.mean(dim=-2, keepdim=True).clamp_(min=self.eps1)
                estimate = (row @ col).div_(mean)
            else:
                estimate = local(s["variance"]).clone()
            update = estimate.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(g)
            self.updates.append(update)
            self.red2[p][0] = update.float().square().sum()

    def apply(self) -> Tensor:
        """Phase 3 (red2 added over the ranks): the step of p; returns the largest |update| applied
        on this rank (0-d fp32; weight decay left out)."""
        group, lr = self.group, self.lr
        amax = torch.zeros((), dtype=torch.float32, device=local(self.params[0]).device)
        for p, s, update in zip(self.params, self.states, self.updates, strict=True):
            u_sq, p_sq = self.red2[p][0], self.red2[p][1]
            root_n = p.numel() ** 0.5
            # min(lr, 1/sqrt(t)) max(eps2, RMS(p)) / max(1, RMS(u) / d), as 0-d fp32 tensors
            alpha = (p_sq.sqrt() / root_n).clamp_(min=self.eps2) * s["step"].rsqrt().clamp_(max=lr)
            coef = alpha / (u_sq.sqrt() / (root_n * group["d"])).clamp_(min=1.0)
            mine = local(p)
            if group["weight_decay"] != 0:
                mine.mul_(1 - lr * group["weight_decay"])
            if group["beta1"] is None:
                mine.sub_(update.float() * coef)  # in fp32, rounded once (a 0-d factor would round to bf16)
            else:  # as the one-process path: m in fp32, stored rounded, p moved by the fp32 value
                mine.sub_(momentum.step(s, group["beta1"], update, coef))
            if update.numel():
                amax = torch.maximum(amax, update.abs().amax().float() * coef)
        return amax
