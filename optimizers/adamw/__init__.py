"""The fused Adam / AdamW family (kernel family ``adamw``, kernel_templates/adamw.py.j2).

optimizer.py: the user classes; plan.py: launch plans (buckets); reference.py: the pure PyTorch
step; tune.py: the tuner's workloads; distributed.py: ZeRO-2 ``DistributedAdamW`` for unwrapped models.
"""

from .distributed import DistributedAdamW
from .optimizer import Adam, AdamW, ReferenceAdam, ReferenceAdamW

__all__ = ["Adam", "AdamW", "DistributedAdamW", "ReferenceAdam", "ReferenceAdamW"]
