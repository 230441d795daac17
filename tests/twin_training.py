"""Helpers for the tests of every tier: two optimizers trained side by side on the same grads."""

from __future__ import annotations

import copy

import torch


def twin_steps(model_a, opt_a, model_b, opt_b, steps: int) -> None:
    """``steps`` steps of both optimizers, each on the same fresh N(0, 1) grads."""
    for _ in range(steps):
        for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()


def scaled_steps(model, opt, device: str, steps: int = 4, inf_at: int = 2, seed: int = 0) -> None:
    """Train ``model`` with ``opt`` under a fresh GradScaler for ``steps`` steps on seeded
    inputs, planting an inf in the first parameter's grad at step ``inf_at``; assert that step
    left every parameter unchanged."""
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    gen = torch.Generator(device=device).manual_seed(seed)
    first = next(iter(model.parameters()))
    for step in range(steps):
        x = torch.randn(4, first.shape[-1], device=device, generator=gen)
        opt.zero_grad()
        scaler.scale(model(x).square().sum()).backward()
        if step == inf_at:
            first.grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if step == inf_at:
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def check_scaler_parity(model, device: str, tol: float, steps: int = 4, inf_at: int = 2) -> None:
    """Our AdamW and torch's fused AdamW (the torch path that takes grad_scale/found_inf in
    its kernel, as ours does) under scaled_steps: parameters within normwise ``tol``
    (0: bitwise), and the inf step not counted."""
    from kernel_factory.optimizers import AdamW
    from kernel_factory.optimizers.parity import compare_tensors

    ref_model = copy.deepcopy(model)
    ours = AdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    scaled_steps(model, ours, device, steps, inf_at)
    scaled_steps(ref_model, theirs, device, steps, inf_at)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q) if tol == 0 else compare_tensors("p", "param", p, q, tol).passed
        assert float(ours.state[p]["step"]) == steps - 1
