"""Optimizer telemetry: counters that live on the device and are read only when asked.

Every optimizer owns a ``Telemetry`` and wraps its ``step()`` in ``telemetry.step(device,
found_inf)``, which counts the step: on the host when it runs eagerly, by one small device op
when it is captured in a CUDA graph (so that the graph's replays keep counting), and a step that
GradScaler's ``found_inf`` skipped by one device op.
Inside the step an optimizer either adds to its counters with tensor ops (``add``: one small
device op each) or, cheaper, points a counter at a value its kernels or its state already hold
(``watch``: nothing is computed until asked). Nothing synchronises until ``summary()``. Step time
is measured with CUDA events around ``step()`` when ``time_steps`` is on (eager steps only).

    opt.telemetry.summary()      # {'steps': 10, 'amax_update': ..., 'step_ms_mean': ...}
    opt.telemetry.time_steps = True
    print(opt.telemetry.table())
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor

# How each counter combines: summed over parameters and all steps so far, or over the
# parameters of the last step only (summed, or the maximum).
TOTAL, STEP_SUM, STEP_MAX = "total", "step_sum", "step_max"
# Every optimizer's: the last step's largest |update| as applied (lr-scaled, weight decay left out).
AMAX_UPDATE = {"amax_update": STEP_MAX}
# Optimizers that take GradScaler's found_inf (and skip the update on the device) count those steps.
SKIPPED_STEPS = "skipped_steps"


class Telemetry:
    """Named device counters; ``kinds`` maps each name to TOTAL, STEP_SUM or STEP_MAX (``steps``
    is always counted; ``skipped_steps``, when named, counts the steps ``found_inf`` skipped)."""

    def __init__(self, kinds: dict[str, str], time_steps: bool = False) -> None:
        self.kinds = dict(kinds)
        self.time_steps = time_steps
        self._values: dict[str, Tensor] = {}
        self._step_values: dict[str, Tensor] = {}
        self._step_reads: dict[str, list[Callable]] = {}  # this step's watched values
        self._total_reads: dict[str, dict[object, Callable]] = {}  # watched running totals, by owner
        self._baseline: dict[str, float] = {}  # watched totals at the last reset()
        self._events: list[tuple] = []
        self._host_steps = 0  # steps run eagerly
        self._counts: Tensor | None = None  # float64 (graph-replayed steps, skipped steps), on the device
        self._increment: Tensor | None = None  # (1, 0) beside it

    def _slot(self, store: dict, name: str, like: Tensor) -> Tensor:
        t = store.get(name)
        if t is None or t.device != like.device:
            t = store[name] = torch.zeros((), dtype=torch.float64, device=like.device)
        return t

    def add(self, name: str, value: Tensor) -> None:
        """Fold one parameter's ``value`` (0-d tensor) of this step into counter ``name``."""
        kind = self.kinds[name]
        slot = self._slot(self._values if kind == TOTAL else self._step_values, name, value)
        if kind == STEP_MAX:
            torch.maximum(slot, value.detach().to(slot.dtype), out=slot)
        else:
            slot.add_(value.detach().to(slot.dtype))

    def watch(self, name: str, read: Callable[[], Tensor | float], owner: object = None) -> None:
        """Fold ``read()`` into counter ``name`` when ``summary()`` is called, not now, so that a
        kernel can keep the counter in its own buffer at no extra device op per step. STEP_SUM
        and STEP_MAX counters: ``read()`` is this step's value (watched anew every step). TOTAL:
        ``read()`` is a running total its ``owner`` keeps (watched once per owner)."""
        if self.kinds[name] == TOTAL:
            self._total_reads.setdefault(name, {})[owner] = read
        else:
            self._step_reads.setdefault(name, []).append(read)

    def _count(self, device: torch.device | None, found_inf: Tensor | None) -> None:
        """Count one step: on the host when it runs eagerly (no device op), on the device when it
        is being captured in a CUDA graph (one small op in the graph: each replay counts), and a
        ``found_inf`` > 0 on the device either way."""
        if self._counts is None:  # at the first step, which runs eagerly (the plans are built in it)
            self._counts = torch.zeros(2, dtype=torch.float64, device=device or "cpu")
            self._increment = torch.zeros(2, dtype=torch.float64, device=device or "cpu")
            self._increment[0] = 1.0
        if self._counts.is_cuda and torch.cuda.is_current_stream_capturing():
            self._counts.add_(self._increment)
        else:
            self._host_steps += 1
        if found_inf is not None and SKIPPED_STEPS in self.kinds:
            self._counts[1:].add_(found_inf.detach().reshape(1).to(self._counts.device) > 0)

    @contextmanager
    def step(self, device: torch.device | None = None, found_inf: Tensor | None = None):
        """Wrap one optimizer step on ``device`` (its first parameter's): resets the per-step
        counters, counts the step (``_count``), and times it with CUDA events when ``time_steps``
        is on and no graph is being captured."""
        for t in self._step_values.values():
            t.zero_()
        self._step_reads.clear()
        self._count(device, found_inf)
        timed = (self.time_steps and device is not None and device.type == "cuda"
                 and not torch.cuda.is_current_stream_capturing())  # fmt: skip
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        yield self
        if timed:
            end.record()
            self._events.append((start, end))

    def summary(self) -> dict[str, float]:
        """Every counter as a Python number (this synchronises), plus step timing if on."""
        counts = [0, 0] if self._counts is None else [int(c) for c in self._counts.tolist()]
        out: dict[str, float] = {"steps": self._host_steps + counts[0]}
        for name in self.kinds:
            if name == SKIPPED_STEPS:
                out[name] = counts[1]
                continue
            t = self._values.get(name, self._step_values.get(name))
            values = ([float(t)] if t is not None else []) + [float(r()) for r in self._watched(name)]
            combine = max if self.kinds[name] == STEP_MAX else sum
            out[name] = combine(values) - self._baseline.get(name, 0.0) if values else 0.0
        if self._events:
            ms = [s.elapsed_time(e) for s, e in self._events]
            out["step_ms_mean"] = sum(ms) / len(ms)
            out["step_ms_last"] = ms[-1]
        return out

    def table(self) -> str:
        """``summary()`` as two aligned columns."""
        items = self.summary()
        width = max(map(len, items))
        return "\n".join(f"{k:<{width}}  {v:g}" for k, v in items.items())

    def _watched(self, name: str) -> list[Callable]:
        return self._step_reads.get(name, []) + list(self._total_reads.get(name, {}).values())

    def reset(self) -> None:
        """Zero every counter (watched running totals are read once here, to count from)."""
        self._baseline = {n: sum(float(r()) for r in reads.values()) for n, reads in self._total_reads.items()}
        self._step_reads.clear()
        self._values.clear()
        self._step_values.clear()
        self._events.clear()
        self._host_steps = 0
        if self._counts is not None:
            self._counts.zero_()
