"""kernel_factory.optimizers: torch.optim-compatible optimizers backed by generated kernels.

One sub-package per family (``adamw``, ``adam_mini``, ``muon``, ``turbo_adam``, ``adafactor``),
``shared`` for what families share, ``parity`` for the parity tools and ``tune`` for the tuning
command line.
"""

from .adafactor import Adafactor
from .adam_mini import AdamMini, ModelShape, NameRules, ReferenceAdamMini, format_table
from .adamw import Adam, AdamW, DistributedAdamW, ReferenceAdam, ReferenceAdamW
from .muon import Muon, fast_newton_schulz
from .shared import precompile
from .shared.clip_grad import clip_grad_norm_
from .turbo_adam import TurboAdam

precompile.start_hash()  # Triton's hash of itself, in the background while the script builds its model

__all__ = ["Adafactor", "Adam", "AdamMini", "AdamW", "DistributedAdamW", "ModelShape", "Muon", "NameRules",
           "ReferenceAdam", "ReferenceAdamMini", "ReferenceAdamW", "TurboAdam", "clip_grad_norm_", "fast_newton_schulz",
           "format_table"]
