"""kernel_factory.optimizers: torch.optim-compatible optimizers backed by generated kernels."""

from .adam import Adam, AdamW, ReferenceAdam, ReferenceAdamW
from .adam_mini import AdamMini, ReferenceAdamMini
from .adam_mini_partition import ModelShape, NameRules, format_table
from .muon import Muon
from .newton_schulz import fast_newton_schulz

__all__ = ["Adam", "AdamMini", "AdamW", "ModelShape", "Muon", "NameRules", "ReferenceAdam", "ReferenceAdamMini",
           "ReferenceAdamW", "fast_newton_schulz", "format_table"]
