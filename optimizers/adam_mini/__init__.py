"""Adam-mini with FP8 momentum (kernel family ``adam_mini``, kernel_templates/adam_mini.py.j2).

optimizer.py: the user class; partition.py: the Hessian blocks from parameter names; plan.py:
launch plans; reference.py: the pure PyTorch step; fp8.py: FP8 momentum storage and its bf16
fallback; tune.py: the tuner's workloads.
"""

from .optimizer import AdamMini, ReferenceAdamMini
from .partition import ModelShape, NameRules, format_table

__all__ = ["AdamMini", "ModelShape", "NameRules", "ReferenceAdamMini", "format_table"]
