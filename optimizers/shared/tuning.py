"""What every tuner task of an in-place optimizer step shares: a snapshot of the tensors a step
updates, and ``restore()`` to put them back between trials and timed runs."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kernel_factory.optimizers.shared import precompile


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


class ModelWorkloadTask(InPlaceTask):
    """Mixin for a task whose workload is a model's parameter list, too large to hold every task's
    at once: ``allocate()`` (the subclass's) builds it at first use, ``release()`` (the tuner calls
    it after the task's study) frees it, and a later use allocates it again. The task's cache key
    (``variant``, ``dtype``, ``numel``) must be known before anything is allocated; ``allocate``
    checks the optimizer's own variant against it (``expect_variant``)."""

    # attributes allocate() sets and release() drops (the floor stays for the report); subclasses add theirs
    WORKLOAD: tuple[str, ...] = ("opt", "params", "_live", "_saved")
    opt = None
    params: list = []
    floor_ms = None  # where it counts state bytes: known once the workload was allocated

    def allocate(self) -> None:
        raise NotImplementedError

    def ensure(self) -> None:
        if self.opt is None:
            try:
                self.allocate()
            except BaseException:  # a half-built workload is not one: the next use starts again
                self.release()
                raise
            # the optimizer's own background compiles (its GradScaler variants, queued when its plan
            # was built) end before a trial is timed: one beside a timed step delays its launches
            precompile.settle()

    def expect_variant(self, family, variant: dict) -> None:
        """RuntimeError unless ``variant`` (the built optimizer's) has the key announced."""
        if family.tuning_key(variant) != self.variant:
            raise RuntimeError(f"{family.name} tuning: the plan's variant {dict(variant)} is not {self.variant}")

    def restore(self) -> None:
        self.ensure()
        super().restore()

    def release(self) -> None:
        """Drop the workload's tensors (``WORKLOAD``) and return the GPU's cached blocks."""
        device = self.params[0].device if self.params else None
        for name in self.WORKLOAD:
            self.__dict__.pop(name, None)
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()
