"""Sharded Muon's owner: the row pieces the ranks sent, into its matrices and their norms (two
launches: kernel_templates/muon_owner.py.j2's gather_kernel, then muon.py.j2's norm_kernel), and
O's rows back into the pieces that return to the ranks (its scatter_kernel); where the peer
copies put the pieces into the matrices' rows in place, the norms alone (its partial_kernel,
then the norm_kernel). Without them
``ShardedMuonBatch`` copies the pieces with one foreach launch each way and takes torch's bf16
``vector_norm`` (a reduction and three small kernels a batch).

The kernels' tiles and config are fixed (not tuned), so every partial sum of the norm adds the
same elements in the same order at any world size: the owner's NS input and norm, and so the
step, are the same bits at 1, 2 or 4 ranks. Against torch's ``vector_norm`` the norm may differ in
its last bf16 place (another order of fp32 additions), as one process's fused kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import MUON, MUON_OWNER, load

from .plan import NORM_BLOCK


class OwnerPieces:
    """Owned matrices (owned, R, C) whose rows are split over the ranks, ``heres[s]`` rows to rank s
    (rows [s P, s P + heres[s])). Flat buffers (``got`` received, ``reply`` to send back) hold
    rank s's pieces (owned, heres[s], C) bf16 at element ``starts[s]``; this rank's own pieces are
    ``own_in`` (its send buffer's own part) and ``own_out`` (its return buffer's), (owned,
    heres[rank], C) bf16 each; ``rows`` (owned, R, C) bf16 contiguous takes the gathered matrices."""

    def __init__(self, got: Tensor, reply: Tensor, own_in: Tensor, own_out: Tensor, starts: list[int],
                 heres: list[int], rows: Tensor, P: int, rank: int) -> None:  # fmt: skip
        self.owned, self.R, self.C = rows.shape
        self.P, self.rank, self.here = P, rank, heres[rank]
        # an empty part is never read or written: any tensor stands in for its pointer
        self.got, self.own_in = got if got.numel() else own_in, own_in if own_in.numel() else got
        self.reply, self.own_out = reply if reply.numel() else own_out, own_out if own_out.numel() else reply
        self.rows = rows
        device = rows.device
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.heres = torch.tensor(heres, dtype=torch.int64, device=device)
        self.config = dict(MUON_OWNER.default_config)
        self.tiles = -(-self.R // self.config["BLOCK_R"]) * -(-self.C // self.config["BLOCK_C"])
        self.partial = torch.empty((self.owned, self.tiles), dtype=torch.float32, device=device)
        self._kernels = load(MUON_OWNER, MUON_OWNER.variant())
        self._norm = load(MUON, MUON.variant(multi_tensor=False)).norm_kernel

    def gather(self, norm: Tensor, eps_bf16: float) -> None:
        """``rows`` from the pieces; ``norm`` (owned,) fp32 = max(bf16(|rows[k]|), eps_bf16)."""
        self._kernels.gather_kernel[(self.tiles, self.owned)](self.got, self.own_in, self.starts, self.heres,
                                                              self.rows, self.partial, self.R, self.C, self.P,
                                                              self.rank, self.here, **self.config)  # fmt: skip
        self._norm_of_partials(norm, eps_bf16)

    def norms(self, norm: Tensor, eps_bf16: float) -> None:
        """``norm`` as ``gather``'s (the same bits), where the pieces were copied into ``rows`` in
        place."""
        self._kernels.partial_kernel[(self.tiles, self.owned)](self.rows, self.partial, self.R, self.C,
                                                               **self.config)  # fmt: skip
        self._norm_of_partials(norm, eps_bf16)

    def _norm_of_partials(self, norm: Tensor, eps_bf16: float) -> None:
        self._norm[(self.owned,)](self.partial, norm, self.tiles, eps_bf16, BLOCK_T=NORM_BLOCK)

    def scatter(self, ortho_rows: Tensor) -> None:
        """O's rows ``ortho_rows`` (owned, R, C) bf16, any strides, into the pieces."""
        if ortho_rows.shape != self.rows.shape or ortho_rows.dtype != torch.bfloat16:
            raise ValueError(f"O's rows must be {tuple(self.rows.shape)} bf16, got {tuple(ortho_rows.shape)} "
                             f"{ortho_rows.dtype}")  # fmt: skip
        self._kernels.scatter_kernel[(self.tiles, self.owned)](ortho_rows, *ortho_rows.stride(), self.reply,
                                                               self.own_out, self.starts, self.heres, self.R,
                                                               self.C, self.P, self.rank, self.here,
                                                               **self.config)  # fmt: skip
