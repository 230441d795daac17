"""The cache lookups the elementwise families' steps make on the bench's model lists, for the
tests that hold sm90.json (test_cache) and the tuner's workloads (test_tuner) to them."""

from __future__ import annotations

import math
from collections.abc import Iterator

from kernel_factory.generator import ADAFACTOR, ADAM_MINI, ADAMW, MUON, TURBO_ADAM
from kernel_factory.optimizers.shared.workloads import MODELS, hidden_matrices, llama_param_shapes


def elementwise_lookups() -> Iterator[tuple[str, object, dict, str, int]]:
    """(model, family, variant, dtype, elements) per model of ``MODELS``, param dtype fp32 and bf16,
    and family at its default layout (AdamW's state in the param dtype, AdamMini's FP8 momentum,
    TurboAdam's 4-bit m and factored v, Adafactor's 8-bit statistics; Muon on the hidden matrices)."""
    for name, config in MODELS.items():
        shapes = llama_param_shapes(**config)
        numel, hidden = (sum(math.prod(s) for _, s in ss) for ss in (shapes, hidden_matrices(shapes)))
        for dtype in ("float32", "bfloat16"):
            for family, axes, n in [
                (ADAMW, dict(param_dtype=dtype, state_dtype=dtype), numel),
                (ADAM_MINI, dict(param_dtype=dtype, momentum="float8e4nv"), numel),
                (MUON, dict(param_dtype=dtype), hidden),
                (TURBO_ADAM, dict(param_dtype=dtype, m_codec="q4", v_codec="factored"), numel),
                (ADAFACTOR, dict(param_dtype=dtype, state_codec="log8"), numel),
            ]:
                yield name, family, family.variant(multi_tensor=True, **axes), dtype, n
