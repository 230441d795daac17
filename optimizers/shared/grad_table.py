"""A device table of gradient addresses for multi-tensor kernels, uploaded only when they change."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .dtensor import local


class GradTable:
    """int64 addresses of one bucket's gradients on ``device``. Autograd usually reuses grad
    tensors, so the table is re-uploaded only when an address changes; a grad that is not
    contiguous or not 16-byte aligned is copied for the step (and the table not reused)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.table = torch.empty(n, dtype=torch.int64, device=device)
        # Addresses go host -> device through one pinned buffer; the event says when the last
        # copy out of it finished, so it is never rewritten under a pending copy.
        self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self._copied = torch.cuda.Event()
        self._ptrs: list[int] | None = None
        self._keep: list[Tensor] = []

    def update(self, params: list[Tensor], checked_grads: Callable[[], list[Tensor]]) -> Tensor:
        """The table for the grads of ``params`` (their local shards for DTensors); ``checked_grads()``
        returns them validated (called only when an address changed)."""
        ptrs = [local(p.grad).data_ptr() for p in params]
        if ptrs == self._ptrs:
            return self.table
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "gradient addresses changed while a CUDA graph is being captured: run a few "
                "eager steps (warm-up) with the same static gradients before capturing"
            )
        grads = checked_grads()
        keep = [g if g.is_contiguous() and g.data_ptr() % 16 == 0 else g.contiguous().clone()
                for g in grads]  # fmt: skip
        self._copied.synchronize()  # the previous upload (long done in practice)
        self._host.copy_(torch.tensor([g.data_ptr() for g in keep], dtype=torch.int64))
        self.table.copy_(self._host, non_blocking=True)
        self._copied.record()
        copied = any(k is not g for k, g in zip(keep, grads, strict=True))
        # A copied grad holds this step's values only: never reuse its table.
        self._ptrs = None if copied else ptrs
        self._keep = keep if copied else []
        return self.table
