"""Telemetry counters: how each kind combines over parameters and steps, and every optimizer's."""

from __future__ import annotations

import pytest
import torch
from mini_models import OPTIMIZERS, fresh_grads, gqa_model, no_decay_optimizer
from twin_training import scaled_steps

from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.shared.telemetry import STEP_MAX, STEP_SUM, TOTAL, Telemetry


def test_counters_combine_by_kind_and_are_read_only_on_request():
    t = Telemetry({"events": TOTAL, "blocks": STEP_SUM, "amax": STEP_MAX})
    for values in ([1, 2], [3, 4]):  # two steps, two parameters each
        with t.step():
            for v in values:
                t.add("events", torch.tensor(v))
                t.add("blocks", torch.tensor(v))
                t.add("amax", torch.tensor(float(v)))
    s = t.summary()
    assert s == {"steps": 2, "events": 10.0, "blocks": 7.0, "amax": 4.0}
    assert "events" in t.table()
    t.reset()
    assert t.summary()["events"] == 0.0 and t.summary()["steps"] == 0


def test_watched_counters_are_read_at_summary_time():
    t = Telemetry({"events": TOTAL, "blocks": STEP_SUM, "amax": STEP_MAX})
    buffer = torch.zeros(3)  # a kernel's own counters: blocks this step, running total of events, amax
    for step, values in enumerate(([2.0, 5.0], [1.0, 3.0])):
        with t.step():
            buffer[0], buffer[2] = values[0], values[1]
            buffer[1] += values[0]
            t.add("blocks", torch.tensor(10.0))  # eager and watched values combine
            t.watch("blocks", lambda: buffer[0])
            t.watch("amax", lambda: buffer[2])
            t.watch("events", lambda: buffer[1], owner="kernel")  # once per owner, however often
        if step == 0:
            assert t.summary() == {"steps": 1, "events": 2.0, "blocks": 12.0, "amax": 5.0}
    # Step values are the last step's only (the first step's reads were dropped), totals keep adding.
    assert t.summary() == {"steps": 2, "events": 3.0, "blocks": 11.0, "amax": 3.0}
    t.reset()
    buffer[1] += 4.0
    assert t.summary()["events"] == 4.0  # counted from the reset


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_counts_steps_and_the_largest_update(name):
    model = gqa_model()
    opt = no_decay_optimizer(name, model)
    for _ in range(3):
        fresh_grads(model)
        before = [p.detach().clone() for p in model.params]
        opt.step()
    moved = max(float((b - p.detach()).abs().max()) for b, p in zip(before, model.params, strict=True))
    s = opt.telemetry.summary()
    assert s["steps"] == 3
    # The update as computed, against what it did to the parameters (rounded to fp32 there).
    assert s["amax_update"] == pytest.approx(moved, rel=1e-4) and moved > 0
    # those take GradScaler's found_inf
    assert ("skipped_steps" in s) == (name in ("AdamW", "Adam", "TurboAdam", "Adafactor"))
    opt.telemetry.reset()
    assert opt.telemetry.summary()["steps"] == 0


def test_steps_skipped_by_found_inf_are_counted():
    model = torch.nn.Linear(8, 4)
    opt = AdamW(model.parameters(), lr=1e-2)
    scaled_steps(model, opt, "cpu", steps=4, inf_at=2)
    s = opt.telemetry.summary()
    assert (s["steps"], s["skipped_steps"]) == (4, 1)


def test_step_times_are_cuda_events_only():
    model = gqa_model()
    opt = no_decay_optimizer("AdamW", model)
    opt.telemetry.time_steps = True
    fresh_grads(model)
    opt.step()
    assert "step_ms_mean" not in opt.telemetry.summary()  # CPU tensors: nothing to time on a device
