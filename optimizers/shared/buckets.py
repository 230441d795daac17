"""What every family's launch plan does with a bucket of tensors (one group's tensors that run the
same way on one device), whatever the family's hyperparameters:

- ``kernel_path``: where a parameter's step runs (the Triton kernels on CUDA or under the
  interpreter, or the family's PyTorch path), with the backend switch and its errors;
- ``share_step_counts``: one device buffer of per-tensor step counts, ``state['step']`` views of it;
- ``pointer_table`` and ``chunk_work_list``: the device tables a multi-tensor launch reads;
- ``LrBuffer``: lr as a device tensor, refilled only when a scheduler changes the float;
- ``log2_pair``: a double split into two fp32 for kernels that need it to ~1e-14;
- ``issue``: a step's launches of some of its phases (split plans run theirs in parts).

A family's plan (e.g. ``adamw/plan.py``) builds its buckets from these and passes its own
hyperparameter object to them; nothing here knows any family's hyperparameters.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor

from kernel_factory.generator import interpreter_enabled, triton_available

# Parameter dtypes the Triton kernels take, by their Triton names.
TRITON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_warned: set[str] = set()
# Frames a warning skips to reach the caller's line: this package's, and torch's (torch.optim's
# constructor calls add_param_group, its step wrappers call step)
_LIBRARY_DIRS = tuple(str(Path(m.__file__).resolve().parent) + os.sep
                      for m in (torch, sys.modules["kernel_factory.generator"],
                                sys.modules[__name__.rsplit(".", 2)[0]]))  # fmt: skip


def warn_once(message: str) -> None:
    """``RuntimeWarning(message)`` the first time this process sees ``message``, attributed to the
    first line outside this package and torch (the user's call)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, called from ``warn_once``, of the first frame outside the
    library directories."""
    frame, level = sys._getframe(2), 2  # warn_once's caller is level 2 of warnings.warn there
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def kernel_path(p: Tensor, mode: str) -> str:
    """Where ``p``'s step runs, for ``mode`` = KERNEL_FACTORY_BACKEND (auto | triton | torch):

    - ``"cuda"``: a CUDA tensor the Triton kernels take;
    - ``"interpreter"``: a CPU tensor under ``triton`` (needs TRITON_INTERPRET=1: else RuntimeError);
    - ``"cpu"``: a contiguous CPU tensor under ``auto``, of any dtype (the family picks its CPU path);
    - ``"reference"``: the family's pure PyTorch path (``torch``, a non-contiguous parameter, a dtype
      the kernels do not take, another device type, no triton installed).
    """
    if mode == "torch":
        return "reference"
    if not p.is_contiguous():
        warn_once("kernel_factory: non-contiguous parameters take the (slower) PyTorch reference path")
        return "reference"
    if p.device.type == "cpu" and mode != "triton":
        return "cpu"
    if p.dtype not in TRITON_DTYPES:
        return "reference"
    if p.device.type == "cpu":
        if not interpreter_enabled():
            raise RuntimeError("KERNEL_FACTORY_BACKEND=triton with CPU tensors needs TRITON_INTERPRET=1 set "
                               "before triton is imported (or use CUDA tensors)")  # fmt: skip
        return "interpreter"
    if p.device.type != "cuda":
        return "reference"
    if not triton_available():
        warn_once("kernel_factory: triton is not installed; CUDA tensors take the PyTorch reference path")
        return "reference"
    return "cuda"


def aligned(tensors: list[Tensor]) -> bool:
    """Whether every tensor starts on a 16-byte boundary (the multi-tensor kernels' vector loads)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def share_step_counts(states: list[dict], device: torch.device) -> Tensor:
    """One float32 buffer (T,) of the step counts in ``states`` (each a 0-d tensor under
    ``'step'``) on ``device``; each ``state['step']`` becomes a view of it, so a kernel advances
    them all on the device and state_dict keeps torch's layout. No host sync."""
    steps = torch.stack([s["step"].detach().reshape(()).to(device, torch.float32) for s in states])
    for i, s in enumerate(states):
        s["step"] = steps[i]
    return steps


def pointer_table(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The int64 addresses of ``tensors`` (T,) on ``device``, for a kernel that loads through them."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)


def chunk_work_list(numels: Tensor, chunk: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Work list (W, 2) int32 of a launch in which program i steps chunk ``work[i, 1]`` (``chunk``
    elements) of tensor ``work[i, 0]``, for tensors of ``numels`` (T,) int64 (CPU), and the chunks
    of each tensor (T,) int32, both on ``device``."""
    nchunks = (numels + chunk - 1) // chunk
    tensor_of = torch.repeat_interleave(torch.arange(len(numels)), nchunks)
    first = torch.cumsum(nchunks, 0) - nchunks
    chunk_of = torch.arange(int(nchunks.sum())) - torch.repeat_interleave(first, nchunks)
    work = torch.stack([tensor_of, chunk_of], 1).to(torch.int32).contiguous().to(device)
    return work, nchunks.to(torch.int32).to(device)


class LrBuffer:
    """lr as a device tensor for kernels that read it (so that a CUDA graph replays the current
    value and a changed float causes no recompilation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = torch.zeros(1, dtype=torch.float32, device=device)
        self._value: float | None = None

    def __call__(self, lr: float | Tensor) -> Tensor:
        """The group's own lr tensor when it is one on this device, else the buffer, refilled only
        when the float changed (no sync: a CPU tensor is read on the host)."""
        if isinstance(lr, Tensor):
            if lr.device == self.device:
                return lr
            lr = float(lr)
        if lr != self._value:
            self._buffer.fill_(lr)
            self._value = lr
        return self._buffer


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def log2_pair(beta: float) -> tuple[float, float]:
    """log2(beta) split into fp32 hi and lo with hi + lo == log2(beta) to ~1e-14 (b^t = 0 for
    beta = 0: hi = -inf)."""
    if beta <= 0:
        return -math.inf, 0.0
    x = math.log2(beta)
    hi = _fp32(x)
    return hi, x - hi


def issue(launches: list[tuple], phases: tuple[str, ...]) -> None:
    """Launch those of ``launches`` ((phase, (kernel, grid, args, kwargs)) in a step's order) whose
    phase is one of ``phases``."""
    for phase, (kernel, grid, args, kwargs) in launches:
        if phase in phases:
            kernel[grid](*args, **kwargs)
