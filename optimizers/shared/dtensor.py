"""DTensor parameters, as FSDP2 (``fully_shard``) and tensor parallelism hand them to an optimizer.

A param is an ``nn.Parameter`` holding a DTensor whose local shard is a view into the buffer the
framework all-gathers from: kernels update ``local(p)`` in place, never a copy, and read
``local(p.grad)``. Param-shaped states are DTensors with the param's mesh and placements
(``torch.zeros_like(p)`` makes one), so that DCP saves and reshards them; their local shards sit
beside the param's. Local shards are uneven and may be empty (a tail rank of a small param).
"""

from __future__ import annotations

from torch import Tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no DTensor can reach us
    DTensor = ()


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (the same tensor object at every call, not a copy), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def refuse_dtensors(params, optimizer: str) -> None:
    """TypeError naming the first DTensor among ``params``: for optimizers that do not take sharded
    parameters yet (their blocks or matrices span shards), rather than a wrong step."""
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            raise TypeError(f"{optimizer} does not take DTensor parameters (FSDP2, tensor parallelism) yet: "
                            f"parameter {i} of shape {tuple(p.shape)} is one; AdamW and Adam do")  # fmt: skip
