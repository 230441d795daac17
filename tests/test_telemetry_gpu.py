"""GPU tier: telemetry of steps replayed from a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch
from mini_models import OPTIMIZERS, gqa_model, no_decay_optimizer

from kernel_factory.generator.timing import capture_graph

pytestmark = pytest.mark.gpu


# Adafactor's preview steps through PyTorch ops that read its step count on the host: it cannot be
# captured until its kernels land (docs/adafactor.md).
CAPTURABLE = [name for name in OPTIMIZERS if name != "Adafactor"]


@pytest.mark.parametrize("name", CAPTURABLE)
def test_graph_replays_keep_counting(name):
    model = gqa_model(device="cuda")
    opt = no_decay_optimizer(name, model, momentum="fp8")
    opt.telemetry.time_steps = True
    for p in model.params:
        p.grad = torch.randn_like(p)  # static grads: the graph reads them in place
    graph = capture_graph(opt.step, warmups=2)
    for _ in range(3):
        before = [p.detach().clone() for p in model.params]
        graph.replay()
    torch.cuda.synchronize()
    moved = max(float((b - p.detach()).abs().max()) for b, p in zip(before, model.params, strict=True))
    s = opt.telemetry.summary()
    assert s["steps"] == 5  # 2 eager + 3 replays (the capture itself runs nothing)
    assert s["amax_update"] == pytest.approx(moved, rel=1e-3) and moved > 0  # the last replay's update
    assert s["step_ms_mean"] > 0  # the eager steps, timed by CUDA events
