"""``clip_grad_norm_`` for gradients that are DTensors on several meshes (FSDP2 + TP, HSDP, expert
meshes) as well as plain tensors; torch's raises "All operands in aten.stack.default must have
the same mesh" when the meshes differ.

The p-norm of all gradients is (Σ_i Σ_x |x|^p)^(1/p) over every element once. Each rank sums
|x|^p over its local shards, per (mesh, placements) group; the group's sums are added over the
mesh dims its gradients are sharded on (one all-reduce per group and sharded dim, not per tensor)
and not over replicated dims, whose ranks hold copies. The inf-norm takes maxima instead. The
clipping coefficient stays on the device: no host sync unless ``error_if_nonfinite``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from .dtensor import DTensor, local


def _sharded_dims(grad: DTensor) -> list[int]:
    """Mesh dims over which ``grad``'s elements are split (Shard and its strided form)."""
    dims = []
    for i, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"clip_grad_norm_: a gradient of shape {tuple(grad.shape)} is Partial on mesh dim {i} "
                             "(not yet reduced); reduce it before clipping")  # fmt: skip
        if not placement.is_replicate():
            dims.append(i)
    return dims


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Scale the gradients of ``parameters`` in place so that their total ``norm_type``-norm is at
    most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``, across meshes. Returns the total norm
    before clipping: a 0-d fp32 tensor (plain, equal on every rank) on the first gradient's device.
    ``foreach`` is accepted for torch's signature; the local sums always use the foreach kernels."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    device = local(grads[0]).device
    groups: dict[tuple, list[Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (None, ())
        groups.setdefault(key, []).append(g)
    infinite = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, _), members in groups.items():
        locals_ = [t for t in (local(g) for g in members) if t.numel()]  # empty shards: no inf-norm identity
        part = torch.zeros((), dtype=torch.float32, device=locals_[0].device if locals_ else device)
        if locals_:
            norms = torch.stack(torch._foreach_norm(locals_, norm_type, dtype=torch.float32))
            part = norms.max() if infinite else norms.pow(norm_type).sum()
        if mesh is not None:
            for dim in _sharded_dims(members[0]):
                dist.all_reduce(part, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                                group=mesh.get_group(dim))  # fmt: skip
        part = part.to(device)
        total = torch.maximum(total, part) if infinite else total + part
    if not infinite:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")  # fmt: skip
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(local(g).device, []).append(local(g))
    for dev, tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(dev))
    return total
