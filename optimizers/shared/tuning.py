"""What every tuner task of an in-place optimizer step shares: a snapshot of the tensors a step
updates, and ``restore()`` to put them back between trials and timed runs."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class InPlaceTask:
    """Mixin: call ``snapshot(tensors)`` once the workload exists; ``restore()`` copies the
    snapshot back into the live tensors."""

    def snapshot(self, tensors: Iterable[torch.Tensor]) -> None:
        self._live = list(tensors)
        self._saved = [t.detach().clone() for t in self._live]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in zip(self._live, self._saved, strict=True):
                live.copy_(saved)
