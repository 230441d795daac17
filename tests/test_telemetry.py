"""Telemetry counters: how each kind combines over parameters and steps."""

from __future__ import annotations

import torch

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
