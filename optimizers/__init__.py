"""kernel_factory.optimizers: torch.optim-compatible optimizers backed by generated kernels."""

from .adam import Adam, AdamW, ReferenceAdam, ReferenceAdamW

__all__ = ["Adam", "AdamW", "ReferenceAdam", "ReferenceAdamW"]
