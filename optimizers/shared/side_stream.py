"""A second CUDA stream for the part of a step that waits on a collective.

A sharded step whose few split blocks need an all-reduce of their sums can leave that chain (the
sums' launch, the all-reduce, the blocks' moments and their rows' launch) to a side stream while
the current stream runs the update of everything else: on the GPU the chain then fills the main
launch's tail instead of following it. ``fork`` makes the side stream wait for the current
stream's work so far; ``join`` makes the current stream wait for the side stream's. Off CUDA
(CPU, Gloo) there is no side stream: ``on`` runs the work in order on the current stream.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """One high-priority stream per CUDA device, made when first used (priority -1: its short
    kernels are scheduled ahead of the main launch's waiting programs)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def fork(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` after it waits for the current stream (None off CUDA)."""
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device, priority=-1)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    @staticmethod
    def on(stream: torch.cuda.Stream | None):
        """A context in which work goes to ``stream`` (a no-op for None)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def join(stream: torch.cuda.Stream | None, device: torch.device) -> None:
        """The current stream of ``device`` waits for ``stream``'s work so far."""
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
