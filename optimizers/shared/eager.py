"""Optimizer steps that ``torch.compile`` runs as they are (a graph break) instead of tracing them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def eager_step(step: Callable) -> Callable:
    """``step`` left out of TorchDynamo's tracing: ``torch.compile`` of ``opt.step`` (or of a
    training step that calls it) runs it eagerly, as the fused kernels it launches already are.
    The steps keep plans, pointer tables and CUDA graphs between calls and branch on host values
    per parameter; traced, Dynamo resumed one parameter's frame with another's locals (Adafactor's
    CPU path raised a KeyError) and AdamMini, Muon and TurboAdam stepped to other values than
    eagerly (tests/test_state_lifecycle.py)."""
    return torch.compiler.disable(step, recursive=True)
