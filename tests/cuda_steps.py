"""Helpers for the GPU tier of fused optimizers: a captured step against eager ones, and steps that
must not synchronise with the host."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernel_factory.generator.timing import capture_graph


def assert_graph_replays_eager(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                               shapes: list[tuple[int, ...]], steps: int = 4) -> torch.optim.Optimizer:  # fmt: skip
    """Two optimizers from ``build(params)`` on the same params and grads, one stepped eagerly and
    one replaying a CUDA graph captured after one warm-up step: params and every state tensor
    equal bit for bit after ``steps`` steps. Returns the graphed optimizer."""
    torch.manual_seed(0)
    init = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(steps)]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    eager, graphed = build(a), build(b)
    for p, q, g in zip(a, b, grads[0], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    eager.step()
    graph = capture_graph(graphed.step, warmups=1)  # the warm-up is step 1
    for step in range(1, steps):
        for p, q, g in zip(a, b, grads[step], strict=True):
            p.grad.copy_(g)
            q.grad.copy_(g)
        eager.step()
        graph.replay()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(eager.state[p][k], graphed.state[q][k]) for k in eager.state[p])
    return graphed


def assert_steps_without_host_sync(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """GradScaler's tensors handed to ``opt`` (scale 64, grads scaled by it): after a step that
    builds its plans, a step and a step with an inf run under ``set_sync_debug_mode("error")``,
    and the skipped one leaves every parameter as it was."""
    for p in params:
        p.grad = torch.randn_like(p) * 64
    opt.grad_scale, opt.found_inf = torch.tensor(64.0, device="cuda"), torch.zeros((), device="cuda")
    opt.step()  # builds the plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        opt.found_inf.fill_(1.0)
        before = [p.detach().clone() for p in params]
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before, strict=True))
