"""TurboAdam: AdamW with compressed moments (the ``turbo_adam`` family).

codecs.py: the state codecs in PyTorch; reference.py: the per-parameter step (the CPU path and the
kernels' oracle); plan.py: the fused launches (kernel_templates/turbo_adam.py.j2); tune.py: the
tuner's workloads; distributed.py: FSDP2's layouts; optimizer.py: the user class.
"""

from .optimizer import TurboAdam

__all__ = ["TurboAdam"]
