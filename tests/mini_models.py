"""Llama-style named models for the Adam-mini tests of every tier."""

from __future__ import annotations

import copy
import io

import torch

from kernel_factory.optimizers import Adafactor, Adam, AdamMini, AdamW, Muon, TurboAdam
from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes

GEOMETRY = dict(dim=32, n_heads=4, n_kv_heads=2)  # GQA: K and V have 2 heads of 8 rows


def gqa_model(seed: int = 0, dtype=torch.float32, device="cpu", **extra) -> ShapeModel:
    """Two layers, dim 32, ffn 48, vocab 40, GQA 4/2 heads, and one bias (a plain-Adam block)."""
    shapes = llama_param_shapes(dim=32, layers=2, ffn=48, vocab=40, n_heads=4, n_kv_heads=2, **extra)
    shapes.append(("layers.1.mlp.down_proj.bias", (32,)))
    return ShapeModel(shapes, dtype=dtype, device=device, seed=seed)


def fresh_grads(*models) -> None:
    """The same fresh N(0, 1) gradient on the matching parameters of every model."""
    for ps in zip(*(m.params for m in models), strict=True):
        g = torch.randn_like(ps[0])
        for p in ps:
            p.grad = g.clone()


def checkpoint_twin(model, opt, build):
    """Step ``opt`` three times, save its state_dict, and load it (``torch.load(weights_only=True)``)
    into ``build(copy)``, an optimizer over a copy of ``model``. Returns (copy, new optimizer)."""
    for _ in range(3):
        fresh_grads(model)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = copy.deepcopy(model)
    twin_opt = build(twin)
    twin_opt.load_state_dict(torch.load(buffer, weights_only=True))
    return twin, twin_opt


def steps_stay_equal(a, opt_a, b, opt_b, steps: int = 3) -> bool:
    """Step both optimizers ``steps`` times on the same fresh grads; True if the parameters of
    ``a`` and ``b`` are still bitwise equal."""
    for _ in range(steps):
        fresh_grads(a, b)
        opt_a.step()
        opt_b.step()
    return all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))


OPTIMIZERS = ["AdamW", "Adam", "AdamMini", "Muon", "TurboAdam", "Adafactor"]


def no_decay_optimizer(name: str, model: ShapeModel, momentum: str = "fp32"):
    """Each of ``OPTIMIZERS`` on ``model`` (``gqa_model``) without weight decay, so that a step's
    update is the parameters' change; Adam with amsgrad, AdamMini with ``momentum``."""
    if name == "AdamMini":
        return AdamMini(model.named(), lr=1e-2, momentum_dtype=momentum, **GEOMETRY)
    if name == "Muon":
        return Muon(model.named(), lr=0.02, weight_decay=0.0, adamw_lr=1e-2)
    if name == "TurboAdam":  # every tensor compressed (the model's are small), blocks of 32
        return TurboAdam(model.parameters(), lr=1e-2, block_size=32, min_m_compress_elements=0,
                         min_v_compress_elements=0)  # fmt: skip
    if name == "Adafactor":  # 8-bit statistics
        return Adafactor(model.parameters(), lr=1e-2)
    return {"AdamW": AdamW, "Adam": Adam}[name](model.parameters(), lr=1e-2, weight_decay=0.0, amsgrad=name == "Adam")
