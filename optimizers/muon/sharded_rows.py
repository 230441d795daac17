"""Muon's momentum and update kernels (kernel_templates/muon.py.j2, through muon_rows.py.j2, which
adds two) on one rank's rows of a batch of FSDP2-sharded matrices (``distributed.ShardedMuonBatch``).

Each rank holds ``here`` rows of every matrix of the batch, each an (here, C) row-major block of
its local shard. The momentum kernel reads g and the buffer once, writes the buffer and NS's bf16
input straight into the rank's piece of the all-to-all's send buffer (B, here, C), rows as they
are (a matrix tall as a whole too: the owner's NS input is the transposed view of its rows).
The update kernel reads the piece of O that comes back in the same layout and writes p once:
p = p (1 - lr wd) - adjusted lr * O. One launch each per batch on CUDA (pointer tables), one per
matrix under the interpreter or where a tensor is not 16-byte aligned. Same arithmetic as one
process's kernels and as the PyTorch ops they replace (``_foreach_lerp_``, ``_foreach_mul_`` and
``_foreach_add_`` in the parameter dtype), so the sharded step stays the one-process step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import MUON, MUON_ROWS, detect_arch, load, select

from ..shared.buckets import TRITON_DTYPES, aligned, pointer_table
from ..shared.checks import checked_grads
from ..shared.grad_table import GradTable


class LocalRowsKernels:
    """The kernels over ``params`` (DTensor matrices of one shape and dtype, fp32, bf16 or fp16;
    ``locals_`` their (here, C) local rows, ``bufs`` their momentum buffers' local rows, of the
    params' dtype), all in the order of the pieces of ``out`` and ``back``, (B, here, C) bf16 each."""

    def __init__(self, params: list[Tensor], locals_: list[Tensor], bufs: list[Tensor], out: Tensor,
                 back: Tensor) -> None:  # fmt: skip
        self.params, self.locals, self.bufs = params, locals_, bufs
        self.out, self.back = out, back
        self.device, dtype = locals_[0].device, locals_[0].dtype
        self.m, self.n = out.shape[1:]
        self.multi_tensor = self.device.type == "cuda" and aligned([*locals_, *bufs])
        arch = "cpu" if self.device.type == "cpu" else detect_arch(self.device)
        # the multi-tensor variant's tuned tiles: the per-matrix variant runs the same tile body
        self.config = dict(select(MUON, arch, MUON.variant(multi_tensor=True, param_dtype=TRITON_DTYPES[dtype]),
                                  TRITON_DTYPES[dtype], len(locals_) * self.m * self.n))  # fmt: skip
        self._variant = dict(multi_tensor=self.multi_tensor, param_dtype=TRITON_DTYPES[dtype])
        self.options = {key: self.config[key] for key in ("BLOCK_R", "BLOCK_C", "num_warps")}  # launch options
        self.tiles = -(-self.m // self.options["BLOCK_R"]) * -(-self.n // self.options["BLOCK_C"])
        # the norm's partial sums, which the kernel writes and nobody reads: the owner takes the
        # norm of the whole matrix
        self._partial = torch.empty((len(locals_), self.tiles), dtype=torch.float32, device=self.device)
        if self.multi_tensor:
            self._p_table, self._buf_table = pointer_table(locals_, self.device), pointer_table(bufs, self.device)
            self._flags = torch.zeros(len(locals_), dtype=torch.int32, device=self.device)  # none transposed
            self._grads = GradTable(self.device, len(locals_))
        self._kernels: dict[bool, object] = {}

    def _module(self, nesterov: bool):
        k = self._kernels.get(nesterov)
        if k is None:
            k = self._kernels[nesterov] = load(MUON_ROWS, MUON_ROWS.variant(**self._variant, nesterov=nesterov))
        return k

    def momentum(self, mu: float, nesterov: bool, own: Tensor | None = None) -> None:
        """buf = lerp(buf, g, 1 - mu) in place; ``out``'s pieces = bf16 of the buffer (Nesterov:
        of lerp(g, buf, mu)). ``own`` (k, here, C) bf16, each piece contiguous: the last k pieces
        go there instead (the owner's own rows, in place in its matrices' rows)."""
        k, m, n = self._module(nesterov), self.m, self.n
        count = len(self.locals)
        if self.multi_tensor:
            grads = self._grads.update(self.params, lambda: checked_grads(self.params))
            if own is not None:
                k.momentum_split_kernel[(self.tiles, count)](grads, self._buf_table, self._flags, self.out, own,
                                                            count - len(own), own.stride(0), self._partial, m, n,
                                                            mu, 1 - mu, **self.options)  # fmt: skip
                return
            k.momentum_kernel[(self.tiles, count)](grads, self._buf_table, self._flags, self.out, self._partial,
                                                  m, n, mu, 1 - mu, **self.options)  # fmt: skip
            return
        pieces = self._pieces(self.out, own)
        for i, (g, buf) in enumerate(zip(checked_grads(self.params), self.bufs, strict=True)):
            k.momentum_kernel[(self.tiles,)](g.contiguous(), buf, 0, pieces[i], self._partial[i],
                                             m, n, mu, 1 - mu, **self.options)  # fmt: skip

    def _pieces(self, flat: Tensor, own: Tensor | None) -> list[Tensor]:
        """Each matrix's (here, C) piece: ``flat``'s, the last ``len(own)`` from ``own``."""
        if own is None:
            return list(flat)
        return list(flat[: len(self.locals) - len(own)]) + list(own)

    def apply(self, decay: float, lr: float, own: Tensor | None = None) -> None:
        """p = p * decay - lr * (the piece of ``back``), in the parameter dtype as torch's foreach
        ops round. ``own`` (k, here, C) bf16, each piece contiguous: the last k pieces from there
        instead (the owner's own rows, read in place in its O)."""
        k, m, n = self._module(False), self.m, self.n
        count = len(self.locals)
        if self.multi_tensor and own is not None:
            k.apply_split_kernel[(self.tiles, count)](self._p_table, self._flags, self.back, own, count - len(own),
                                                     own.stride(0), m, n, decay, lr, lr, **self.options)  # fmt: skip
            return
        if self.multi_tensor:
            k.apply_kernel[(self.tiles, count)](self._p_table, self._flags, self.back, m, n, decay, lr, lr,
                                               **self.options)  # fmt: skip
            return
        pieces = self._pieces(self.back, own)
        for i, p in enumerate(self.locals):
            k.apply_kernel[(self.tiles,)](p, 0, pieces[i], m, n, decay, lr, lr, **self.options)
