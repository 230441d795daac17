"""Adafactor on FSDP2's sharded parameters (dim 0 split on one mesh dim: ``row_shard_group``), in
PyTorch ops on the local shards.

States keep global shapes that do not depend on the world size (DISTRIBUTED.md, rule 4), so DCP
reshards them: a matrix's ``row_var`` [R, 1] is split like its rows and its ``col_var`` [1, C] is
replicated; a tensor of 3+ dims split on dim 0 holds whole matrices, so both its statistics are
split like it; a vector's ``variance`` like the vector. They are kept in the param dtype, as torch
keeps them (``state_bits=32``): the 8-bit codes' blocks of 128 rows would straddle the shards,
and the statistics are (R + C) / (R C) of the parameters anyway.

A step of a param group's sharded params takes two all-reduces per shard group, for all its
params at once: (1) the column sums of g² of the split matrices, the sums of their new row
statistics (their mean over all rows) and every param's sum of p² (RMS(p)); (2) every param's
sum of u² (RMS of the update). Every rank then advances the same replicated column EMA. The
first moment (``beta1``) is split like the param; int8 codes and their per-row block scales
where the rows are split (momentum.py), bf16 for a vector.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..shared.dtensor import DTensor, Replicate, local, row_shard_group, split_like
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


def _all_reduce(values: dict[int, list[Tensor]], groups: dict[int, object]) -> dict[int, list[Tensor]]:
    """Each list of fp32 tensors summed across its shard group: one all-reduce per group."""
    out = {}
    for key, ts in values.items():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=groups[key])
        out[key] = [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in ts]), ts, strict=True)]
    return out


def _lerp_(state: Tensor, target: Tensor, w: Tensor) -> None:
    """state = lerp(state, target, w) in fp32, rounded once to state's dtype, as torch's lerp with a
    Python weight computes it; ``w`` a 0-d fp32 tensor on state's device (a tensor weight of a
    half-precision lerp would be rounded to its dtype first)."""
    state.copy_(state.float().lerp_(target.float(), w))


def sharded_steps(params: list[DTensor], grads: list[Tensor], states: list[dict], group: dict, lr: float,
                  eps1: float, eps2: float) -> Tensor:  # fmt: skip
    """One Adafactor step of sharded ``params`` (local ``grads``: unscaled, negated under
    ``maximize``) with ``group``'s hyperparameters; returns the largest |update| applied on this
    rank (0-d fp32; weight decay left out). No host sync: step counts, RMS(p) and RMS(u) stay on
    the device (each state's ``step`` lives there)."""
    groups, first, weights = {}, {}, []
    for p, g, s in zip(params, grads, states, strict=True):
        key = id(row_shard_group(p)[0])
        groups[key] = row_shard_group(p)[0]
        s["step"] += 1
        w = s["step"].pow(group["beta2_decay"])  # 1 - beta2_t
        weights.append(w)
        mine = local(p)
        sums = [mine.float().square().sum()]
        if p.dim() >= 2:
            row, col = local(s["row_var"]), local(s["col_var"])
            _lerp_(row, torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), w)
            if p.dim() == 2:  # the columns' sums of g² and the rows' sum of the statistic span the ranks
                sums += [row.float().sum(), g.float().square().sum(dim=-2, keepdim=True)]
            else:
                _lerp_(col, torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)), w)
        else:
            _lerp_(local(s["variance"]), g * g, w)
        first.setdefault(key, []).extend(sums)
    reduced, updates, second = _all_reduce(first, groups), [], {}
    taken = dict.fromkeys(reduced, 0)
    for p, g, s, w in zip(params, grads, states, weights, strict=True):
        key = id(row_shard_group(p)[0])
        n = 3 if p.dim() == 2 else 1
        sums, taken[key] = reduced[key][taken[key] : taken[key] + n], taken[key] + n
        if p.dim() >= 2:
            row, col = local(s["row_var"]), local(s["col_var"])
            if p.dim() == 2:
                _lerp_(col, (sums[2] / p.shape[0]).to(col.dtype), w)
                mean = (sums[1] / p.shape[0]).to(row.dtype).clamp_(min=eps1)
            else:
                mean = row.mean(dim=-2, keepdim=True).clamp_(min=eps1)
            estimate = (row @ col).div_(mean)
        else:
            estimate = local(s["variance"]).clone()
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
        updates.append((sums[0], update))
        second.setdefault(key, []).append(update.float().square().sum())
    reduced = _all_reduce(second, groups)
    taken = dict.fromkeys(reduced, 0)
    amax = torch.zeros((), dtype=torch.float32, device=local(params[0]).device)
    for p, s, (p_sq, update) in zip(params, states, updates, strict=True):
        key = id(row_shard_group(p)[0])
        u_sq, taken[key] = reduced[key][taken[key]], taken[key] + 1
        root_n = p.numel() ** 0.5
        # min(lr, 1/sqrt(t)) max(eps2, RMS(p)) / max(1, RMS(u) / d), as 0-d fp32 tensors
        alpha = (p_sq.sqrt() / root_n).clamp_(min=eps2) * s["step"].rsqrt().clamp_(max=lr)
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
