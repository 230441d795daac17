"""Sharded Muon's owner: the row pieces the ranks sent, into its matrices and their norms, in two
launches (kernel_templates/muon_owner.py.j2's gather_kernel, then muon.py.j2's norm_kernel),
where ``ShardedMuonBatch.before_ns`` otherwise copies the pieces with one foreach launch and takes
torch's bf16 ``vector_norm`` (a reduction and three small kernels a batch).

The gather's tiles and config are fixed (not tuned), so every partial sum of the norm adds the
same elements in the same order at any world size: the owner's NS input and norm, and so the
step, are the same bits at 1, 2 or 4 ranks. Against torch's ``vector_norm`` the norm may differ in
its last bf16 place (another order of fp32 additions), as one process's fused kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import MUON, MUON_OWNER, load

from .plan import NORM_BLOCK


class OwnerGather:
    """For owned matrices whose rows (R, C) are split over the ranks in ``heres`` rows each (rank s
    holds rows [s P, s P + heres[s])): ``got`` the flat received buffer, rank s's part
    (owned, heres[s], C) bf16 at element ``starts[s]``; ``own`` this rank's own part
    (owned, heres[rank], C) bf16; ``rows`` the output (owned, R, C) bf16 contiguous."""

    def __init__(self, got: Tensor, own: Tensor, starts: list[int], heres: list[int], rows: Tensor, P: int,
                 rank: int) -> None:  # fmt: skip
        self.owned, self.R, self.C = rows.shape
        self.P, self.rank, self.here = P, rank, heres[rank]
        # an empty part is never read: any tensor stands in for its pointer
        self.got = got if got.numel() else own
        self.own = own if own.numel() else self.got
        self.rows = rows
        device = rows.device
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.heres = torch.tensor(heres, dtype=torch.int64, device=device)
        self.config = dict(MUON_OWNER.default_config)
        self.tiles = -(-self.R // self.config["BLOCK_R"]) * -(-self.C // self.config["BLOCK_C"])
        self.partial = torch.empty((self.owned, self.tiles), dtype=torch.float32, device=device)
        self._gather = load(MUON_OWNER, MUON_OWNER.variant()).gather_kernel
        self._norm = load(MUON, MUON.variant(multi_tensor=False)).norm_kernel

    def __call__(self, norm: Tensor, eps_bf16: float) -> None:
        """``rows`` from the pieces; ``norm`` (owned,) fp32 = max(bf16(|rows[k]|), eps_bf16)."""
        self._gather[(self.tiles, self.owned)](self.got, self.own, self.starts, self.heres, self.rows, self.partial,
                                              self.R, self.C, self.P, self.rank, self.here,
                                              **self.config)  # fmt: skip
        self._norm[(self.owned,)](self.partial, norm, self.tiles, eps_bf16, BLOCK_T=NORM_BLOCK)
