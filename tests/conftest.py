"""Test setup: without a GPU, Triton kernels run under the interpreter (set before any import
of triton), on small shapes, fp32/fp16 only (DESIGN.md, "Testing on machines without a GPU")."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
