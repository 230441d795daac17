"""kernel_factory.optimizers: torch.optim-compatible optimizers backed by generated kernels."""

from .adam import Adam, AdamW, ReferenceAdam, ReferenceAdamW
from .adam_mini import AdamMini, ReferenceAdamMini
from .adam_mini_partition import ModelShape, NameRules, format_table

__all__ = ["Adam", "AdamMini", "AdamW", "ModelShape", "NameRules", "ReferenceAdam", "ReferenceAdamMini",
           "ReferenceAdamW", "format_table"]
