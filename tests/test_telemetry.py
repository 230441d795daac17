"""Telemetry counters: how each kind combines over parameters and steps."""

from __future__ import annotations

import torch

from kernel_factory.optimizers.telemetry import STEP_MAX, STEP_SUM, TOTAL, Telemetry


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
