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
