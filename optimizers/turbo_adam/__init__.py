"""TurboAdam: AdamW with compressed moments (the ``turbo_adam`` family).

codecs.py: the state codecs in PyTorch; reference.py: the per-parameter step; optimizer.py: the
user class.
"""

from .optimizer import TurboAdam

__all__ = ["TurboAdam"]
