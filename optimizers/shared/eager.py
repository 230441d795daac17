"""Optimizer steps that ``torch.compile`` runs as they are (a graph break) instead of tracing them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def eager_step(step: Callable) -> Callable:
    """``step`` left out of TorchDynamo's tracing: ``torch.compile`` of ``opt.step`` (or of a
    training step that calls it) runs it eagerly, as the fused kernels it launches already are.
    The steps keep plans, pointer tables and CUDA graphs between calls and branch on host values
    per parameter; traced, Dynamo resumed one parameter's frame with another's locals (Adafactor's
    CPU path raised a KeyError) and AdamMini, Muon and TurboAdam stepped to other values than
    eagerly (tests/test_state_lifecycle.py).

    The disabled function is made at the first call, not at import: ``torch.compiler.disable``
    imports TorchDynamo, which imports Triton, and Triton reads ``TRITON_INTERPRET`` when it is
    imported (a script that sets it after importing this package, as the parity matrix does,
    would get a half-interpreted Triton); torch.optim's constructor imports Dynamo anyway."""

    @functools.cache
    def disabled() -> Callable:
        return torch.compiler.disable(step, recursive=True)

    @functools.wraps(step)
    def run(*args, **kwargs):
        return disabled()(*args, **kwargs)

    return run
