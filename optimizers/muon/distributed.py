"""Muon on FSDP2's sharded matrices: an owner rank per matrix, two all-to-alls per batch.

Newton–Schulz needs whole matrices; FSDP2 holds each rank's rows (``torch.chunk`` on dim 0). A
batch is one group's DTensor matrices of one full shape, dtype and shard group (the mesh dim
their rows are split on; replicated mesh dims, as in HSDP, hold copies and exchange among
themselves). Per step:

1. each rank updates the momentum of its rows (elementwise, the buffer a DTensor like the param)
   and rounds NS's input to bf16, as single-process Muon does before NS: on the Triton kernels of
   one process (``sharded_rows.py``) where those run, written straight into the send buffer;
2. an all-to-all sends every matrix's rows to its owner (matrix j belongs to rank j mod W), each
   rank's rows as they are (no padding: the owner's matrix is exactly the single-process one);
3. the owner runs NS once on its matrices (normalization and iterations as single-process Muon;
   on CUDA the batches of a device together, through the CUDA graph one process replays);
4. a second all-to-all returns each rank's rows of O, and each rank applies weight decay and the
   update to its rows (the kernels again where they run).

Every matrix is orthogonalized once per step on its fully reduced gradient, by the same arithmetic
as in one process, so the result does not depend on the world size; the traffic is about twice
the batch in bf16, where gathering every matrix everywhere moves W/2 times more and repeats NS on
every rank.

Matrices split otherwise (tensor parallelism's ``Shard(1)``, FSDP2 + TP's 2-D layouts) take that
plain scheme (``GatheredMuonBatch``): each rank gathers each whole matrix, runs NS on the batch and
keeps its own part of O; the same arithmetic again, so the same bits as one process.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _coalescing_manager

from kernel_factory.generator import backend_mode

from ..shared.buckets import kernel_path
from ..shared.checks import checked_grads
from ..shared.dtensor import DTensor, local, local_part, row_shard_group
from . import peer_copies as peer_copy
from .newton_schulz import iterate, ns_on_triton
from .owner_pieces import OwnerPieces
from .plan import JointNS, MuonHyper, adjusted_lr, init_momentum_buffer, on_device
from .sharded_rows import LocalRowsKernels


class ShardedMuonBatch:
    """Same-shape DTensor matrices of one group, dtype and shard group (module docstring). Buffers
    are kept between steps: the all-to-alls' send and receive buffers, and NS's input ``x`` (the
    owner's matrices, (owned, m, n) bf16, m <= n, tall ones transposed) and ``norm`` (owned,) fp32,
    which a CUDA graph of the device's NS iterations reads in place (``plan.JointNS``).

    Layout: this rank's rows of each matrix are one piece, (here, C). A matrix tall as a whole
    is x's transposed view: its rows fill row blocks of a contiguous (owned, R, C) buffer, which
    NS reads in place, as every piece is copied in and out by one foreach launch each way. The
    send buffer holds the pieces owner by owner (owner r's matrices j = r, r + W, ...), the other
    owners in rank order and this rank last, so that each owner's part is contiguous and the
    all-to-all moves no padding; the owner receives (owned, rows of rank s, C) from each other
    rank s, and sends it back the same way. A rank's pieces of its own matrices stay out of the
    all-to-alls (NCCL would copy them within the rank, on its few SMs, as part of the exchange):
    NS's input is copied from the send buffer's last part and O into the return buffer's. With
    the peer copies the pieces may skip the receive and reply buffers (``direct_pieces``,
    ``direct_replies``: each way one pitched copy per peer and batch between the send or return
    buffer and the owner's matrices' rows or O, and the own rows written and read in place). ``mode``: the
    Triton kernels write and read the pieces (``sharded_rows``) where ``kernel_path`` gives
    ``cuda`` or ``interpreter``; else PyTorch's foreach ops.

    ``owner_kernels = True`` (on the class, the default): on those paths the owner's copy of the
    pieces into x and its norms run as two launches, and its copy of O into the pieces as one
    (``owner_pieces``), instead of a foreach copy each way and torch's bf16 ``vector_norm`` (on two
    H200s at 123M the step's GPU time 1.757 -> 1.662-1.665 ms, kernels 86 -> 70 a step;
    benchmarks/results/bench_dist/muon_owner_kernels_w2.md)."""

    owner_kernels = True
    # ``peer_copies``: the exchanges as copies into the peers' symmetric buffers and flags
    # (``peer_copies.py``) instead of NCCL's all-to-alls. ``"auto"`` (the default): where the shard
    # group is two ranks of NCCL whose GPUs reach each other's memory (``peer_copies.direct_peers``):
    # on two H200s at 123M the step's GPU time 1.660-1.662 -> 1.481-1.485 ms; at four no faster
    # (1.073 vs 1.067 ms, 44 launches more; benchmarks/results/bench_dist/muon_peer_copies_w2.md).
    # True: at any size (GPUs that reach each other, else a RuntimeError; on CPU devices
    # ``peer_copies.POOL``'s stand-in); False: the all-to-alls (``peer_copies.takes_peer_copies``)
    peer_copies: bool | str = "auto"
    # ``direct_replies`` (with the peer copies): each rank's rows of O are copied to it straight
    # from NS's output (``peer_copies.copy_blocks``, the copy engines) and the owner's update reads
    # its own rows there, instead of a scatter launch of O into the reply and return buffers
    # first; where O's rows are contiguous blocks (NS wrote O in the rows' layout). On two H200s at
    # 123M the step's GPU time 1.483-1.487 -> 1.440-1.441 ms (muon_direct_copies_w2.md)
    direct_replies = True
    # ``direct_pieces`` (with the peer copies): each rank's pieces are copied straight into the
    # owner's matrices' rows (one pitched copy per owner and batch) and the owner's momentum
    # kernel writes its own rows there, so the owner takes the norms alone (``OwnerPieces.norms``)
    # instead of gathering the pieces from a receive buffer first (then 1.431-1.436 -> 1.412-1.417)
    direct_pieces = True

    def __init__(self, params: list[DTensor], bufs: list[DTensor], mode: str) -> None:
        self.params, self.bufs = params, bufs
        self.group, self.world, self.rank = row_shard_group(params[0])
        self.rows = params[0].shape[0]
        self.cols = math.prod(params[0].shape[1:])
        self.per_rank = -(-self.rows // self.world)
        self.local_params = [local(p) for p in params]
        self.local_bufs = [local(b) for b in bufs]
        self.owned = list(range(self.rank, len(params), self.world))
        self.device = self.local_params[0].device
        self.dtype = params[0].dtype
        self.tall = self.rows > self.cols
        # NCCL can take a stage's all-to-alls as one group (ShardedMuonGroupPlan.coalesce); Gloo cannot
        self.nccl = self.device.type == "cuda" and "nccl" in str(dist.get_backend(self.group))
        W, P, C = self.world, self.per_rank, self.cols
        bf16 = dict(dtype=torch.bfloat16, device=self.device)
        # rows each rank holds (torch.chunk: ceil(R / W), the last non-empty chunk shorter)
        heres = [max(0, min(P, self.rows - s * P)) for s in range(W)]
        here, owned = heres[self.rank], len(self.owned)
        owners = [r for r in range(W) if r != self.rank] + [self.rank]  # this rank's own pieces last
        self.order = [j for r in owners for j in range(r, len(params), W)]  # pieces, owner by owner
        # elements to owner r and from rank s through the exchanges (none to or from this rank)
        sizes, sent_at, got_at = peer_copy.piece_offsets(W, len(params), heres, C)
        self._to_owner = sizes[self.rank]
        self._from_rank = [sizes[s][self.rank] for s in range(W)]
        starts = got_at[self.rank]
        self._send = torch.zeros((len(params), here, C), **bf16)
        self._reply = torch.zeros(sum(self._from_rank), **bf16)  # flat: split by element
        self._peer_copies: tuple | None = None  # (pool, copies to the owners, copies back), where taken
        copies = peer_copy.takes_peer_copies(self.peer_copies, W, self.nccl, self.device, self.group)
        self._direct = copies and self.direct_replies  # taken once: the NS graph bakes in the scatter or not
        self._direct_in = copies and self.direct_pieces  # and the gather or the norms alone
        owned_by = [len(range(r, len(params), W)) for r in range(W)]  # matrices of each owner
        if copies:
            # every rank's receive region (its matrices' rows where the pieces go there in place,
            # else the others' pieces), then its return buffer, at the same offsets in each pool
            got_max = max(owned_by[r] * self.rows * C if self._direct_in else sum(sizes[s][r] for s in range(W))
                          for r in range(W))  # fmt: skip
            pool = peer_copy.POOL(got_max + len(params) * P * C, self.device, self.group)
            self._got = pool.local[: sum(self._from_rank)]  # not read where the pieces land in the rows
            self._back = pool.local[got_max : got_max + len(params) * here * C].view(len(params), here, C)
        else:
            self._got = torch.zeros(sum(self._from_rank), **bf16)
            self._back = torch.zeros((len(params), here, C), **bf16)
        away = len(params) - owned  # the pieces of other owners' matrices: _send[:away], _back[:away]
        self._away = (self._send[:away].view(-1), self._back[:away].view(-1))
        if copies:
            remote = {r: pool.remote(r) for r in range(W) if r != self.rank}
            flat = lambda t: t.view(1, 1, -1)  # noqa: E731 (one block for copy_blocks)
            out = []  # to owner r: this rank's pieces, into its receive buffer or its matrices' rows
            for r, n in enumerate(sizes[self.rank]):
                piece = self._away[0][sent_at[self.rank][r] :][:n]
                if n and self._direct_in:
                    its_rows = remote[r][: owned_by[r] * self.rows * C].view(owned_by[r], self.rows, C)
                    out.append((its_rows[:, self.rank * P : self.rank * P + here], piece.view(owned_by[r], here, C)))
                elif n:
                    out.append((flat(remote[r][got_at[r][self.rank] :][:n]), flat(piece)))
            back = [(flat(remote[s][got_max + sent_at[s][self.rank] :][:n]), flat(self._reply[starts[s] :][:n]))
                    for s, n in enumerate(self._from_rank) if n]  # fmt: skip
            self._peer_copies = (pool, out, back)
            # direct replies: rank s's rows [a, b) of the owned matrices, into its return buffer
            self._reply_to = [(remote[s][got_max + sent_at[s][self.rank] :][: owned * heres[s] * C]
                               .view(owned, heres[s], C), s * P, s * P + heres[s])
                              for s in range(W) if s != self.rank and heres[s] and owned]  # fmt: skip
        self._own_rows = (self.rank * P, self.rank * P + here)  # this rank's rows of every matrix
        # direct replies: O's rows (owned, R, C) that this step's copies read, and this rank's own
        # rows of them (owned, here, C), which its update reads (kept to the next step: update_amax)
        self._reply_rows: Tensor | None = None
        self._own_o: Tensor | None = None
        # rank s's pieces of the owned matrices, and the rows of x (tall: columns) they fill
        self._spans = [(s, s * P, s * P + heres[s]) for s in range(W) if heres[s]]

        def parts(flat: Tensor, own: Tensor) -> dict[int, Tensor]:  # rank s's part of a received or sent buffer
            got = {s: flat[starts[s] : starts[s] + self._from_rank[s]] for s, _, _ in self._spans}
            return {s: own if s == self.rank else part.view(owned, heres[s], C) for s, part in got.items()}

        self._got_parts, self._reply_parts = parts(self._got, self._send[away:]), parts(self._reply, self._back[away:])
        # the owned matrices' rows (in the pool where the pieces are copied there)
        rows = pool.local[: owned * self.rows * C].view(owned, self.rows, C) if self._direct_in \
            else torch.empty((owned, self.rows, C), **bf16)  # fmt: skip
        # where this rank's momentum writes its rows of the owned matrices: in place, or the send
        # buffer's own part (``_send[away:]``), which ``before_ns`` gathers from
        self._own_x = rows[:, self._own_rows[0] : self._own_rows[1]] if self._direct_in and owned else None
        self._send_to = list(self._send.unbind(0)) if self._own_x is None else \
            [*self._send[:away].unbind(0), *self._own_x.unbind(0)]  # fmt: skip
        self.x = rows.mT if self.tall else rows  # (owned, m, n), m <= n
        self.pieces = None  # the kernels' gather, norm and scatter (owner_pieces.py), where taken
        if owned and self.owner_kernels and kernel_path(self.local_params[0], mode) in ("cuda", "interpreter"):
            self.pieces = OwnerPieces(self._got, self._reply, self._send[away:], self._back[away:], starts, heres,
                                      rows, P, self.rank)  # fmt: skip
        else:
            # each piece is a contiguous block of rows, all copied in one foreach launch (a copy of
            # a strided view, a tall matrix's transposed piece, ran at a fraction of the copy rate)
            pairs = [(rows[k, a:b], self._got_parts[s][k]) for s, a, b in self._spans for k in range(owned)]
            self._unpack = ([d for d, _ in pairs], [g for _, g in pairs])
            self._pieces = [self._reply_parts[s][k] for s, _, _ in self._spans for k in range(owned)]
        self._pack_from: tuple[int, list[Tensor]] = (0, [])  # (address of O, its pieces' views)
        self.norm = torch.empty(owned, dtype=torch.float32, device=self.device)
        self._amax_lr: float | None = None  # the last step's adjusted lr (update_amax)
        self.graphed = False  # before_ns and after_ns run inside the device's NS graph (OwnerNS)
        self._work = None  # the all-to-all in flight (send -> receive, reply -> apply)
        self.kernels = None
        if here and kernel_path(self.local_params[0], mode) in ("cuda", "interpreter"):
            self.kernels = LocalRowsKernels([params[j] for j in self.order], [self.local_params[j] for j in self.order],
                                            [self.local_bufs[j] for j in self.order], self._send,
                                            self._back)  # fmt: skip

    def send(self, h: MuonHyper, exchange: bool = True) -> None:
        """Step 1 and 2's start: the momentum of this rank's rows, NS's bf16 input sent to the
        owners by an all-to-all left running (``receive`` waits for it); ``exchange=False``: the
        caller issues it (``to_owners``)."""
        if self.kernels is not None:
            self.kernels.momentum(h.momentum, h.nesterov, self._own_x)
        elif self._send.numel():
            grads = checked_grads(self.params)
            torch._foreach_lerp_(self.local_bufs, grads, 1 - h.momentum)
            updates = torch._foreach_lerp(grads, self.local_bufs, h.momentum) if h.nesterov else self.local_bufs
            rows = [updates[j].reshape(-1, self.cols) for j in self.order]
            torch._foreach_copy_(self._send_to, rows)
        if exchange:
            self.to_owners()

    def to_owners(self) -> None:
        """The all-to-all of NS's input to the owners, left running (none on one rank); with
        ``peer_copies`` only the copies into the owners' buffers (the plan raises the flags)."""
        self._move(1, self._got, self._away[0], self._from_rank, self._to_owner)

    def receive(self, h: MuonHyper) -> None:
        """Step 2's end: once the all-to-all is done (on CUDA the stream waits, not the host), the
        owner's matrices into ``x`` and their norms (``before_ns``; in the NS graph where the
        batch is ``graphed``)."""
        if self._work is not None:
            self._work.wait()
        if not self.graphed:
            self.before_ns(h.eps_bf16)

    def before_ns(self, eps_bf16: float) -> None:
        """The owner's matrices into ``x`` (rank s's pieces are rows [a, b) of each; a tall
        matrix's rows are x's columns; with ``direct_pieces`` they are there already) and their
        norms (as torch's bf16 vector_norm, at least eps; the owner kernels' where taken): static
        buffers in, static out."""
        if self.pieces is not None:
            (self.pieces.norms if self._direct_in else self.pieces.gather)(self.norm, eps_bf16)
            return
        if self.owned and not self._direct_in:
            torch._foreach_copy_(*self._unpack)
        self.norm.copy_(torch.linalg.vector_norm(self.x, dim=(-2, -1)).float().clamp_(min=eps_bf16))

    def after_ns(self, ortho: Tensor) -> None:
        """Each rank's rows of O (the owner's ``ortho``, (owned, m, n); a tall matrix's rows are
        its columns) into the reply buffer: one foreach copy, of contiguous blocks where NS wrote
        O in x's layout (``newton_schulz_launch.update_output``), or the owner kernels' scatter."""
        if self._direct_rows(ortho) is not None:
            return  # ``to_ranks`` copies straight from O, and ``apply`` reads the own rows there
        if self.pieces is not None:
            self.pieces.scatter(ortho.mT if self.tall else ortho)
        elif self.owned:
            if self._pack_from[0] != ortho.data_ptr():  # a CUDA graph's output stays put: views kept
                rows, owned = (ortho.mT if self.tall else ortho), range(len(self.owned))
                self._pack_from = (ortho.data_ptr(), [rows[k, a:b] for _, a, b in self._spans for k in owned])
            torch._foreach_copy_(self._pieces, self._pack_from[1])

    def orthogonalize(self, h: MuonHyper) -> Tensor:
        """NS of this batch alone, on torch's ops (CPU; the CUDA batches run as one graph)."""
        return orthogonalize(self.x, h)

    def reply(self, h: MuonHyper, ortho: Tensor, exchange: bool = True) -> None:
        """Step 4's start: each rank's rows of O (``after_ns``, done in the NS graph where the batch
        is ``graphed``) sent back to it by an all-to-all left running (``apply`` waits for it);
        ``exchange=False``: the caller issues it (``to_ranks``)."""
        self._reply_rows = rows = self._direct_rows(ortho)
        self._own_o = None if rows is None else rows[:, self._own_rows[0] : self._own_rows[1]]
        if not self.graphed:
            self.after_ns(ortho)
        if exchange:
            self.to_ranks()

    def _direct_rows(self, ortho: Tensor) -> Tensor | None:
        """O's rows (owned, R, C), where the replies go straight from them (``direct_replies``
        with the peer copies, and each matrix's rows contiguous in O); else None. A pure function
        of O's layout: the NS graph's capture (``after_ns``) and each step (``reply``) agree."""
        if not self._direct or not self.owned:
            return None
        rows = ortho.mT if self.tall else ortho
        return rows if rows.stride(-1) == 1 and rows.stride(-2) == self.cols else None

    def to_ranks(self) -> None:
        """The all-to-all of O's rows back to the ranks that hold them, left running (none on one
        rank); with ``peer_copies`` only the copies into the ranks' buffers."""
        self._move(2, self._away[1], self._reply, self._to_owner, self._from_rank)

    def _move(self, way: int, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """One exchange: ``inp`` split by ``in_splits`` to the ranks, ``out`` by ``out_splits`` from
        them (an all-to-all left running), or ``_peer_copies[way]``'s copies."""
        if self.world == 1:
            return
        if self._peer_copies is not None and way == 2 and self._reply_rows is not None:
            for dst, a, b in self._reply_to:
                peer_copy.copy_blocks(dst, self._reply_rows[:, a:b])
            return
        if self._peer_copies is not None:
            for dst, src in self._peer_copies[way]:
                peer_copy.copy_blocks(dst, src)
            return
        self._work = dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                            group=self.group, async_op=True)  # fmt: skip

    def apply(self, h: MuonHyper) -> None:
        """Step 4's end: once this rank's rows of O are back, weight decay and the update on them."""
        if self._work is not None:
            self._work.wait()
        self._reply_rows = None  # copied out (O stays put until NS's next run: a graph's, or _own_o's)
        step_lr = adjusted_lr(h.lr, h.adjust_lr_fn, self.rows, self.cols)
        decay = 1 - h.lr * h.weight_decay
        if self.kernels is not None:
            self.kernels.apply(decay, step_lr, self._own_o)
        else:
            torch._foreach_mul_(self.local_params, decay)
            if self._back.numel():  # p.add_ computes in p's dtype, as single-process Muon after .to(p.dtype)
                mine = [o.reshape(self.local_params[j].shape)
                        for j, o in zip(self.order, self._my_o(), strict=True)]  # fmt: skip
                torch._foreach_add_([self.local_params[j] for j in self.order], mine, alpha=-step_lr)
        self._amax_lr = step_lr

    def _o_parts(self) -> list[Tensor]:
        """This rank's rows of O, (k, here, C) blocks in the pieces' order: the return buffer, or
        its other owners' part and the own rows in O itself where the replies go direct."""
        if self._own_o is None:
            return [self._back]
        return [self._back[: len(self.params) - len(self.owned)], self._own_o]

    def _my_o(self) -> list[Tensor]:
        """This rank's rows of O of each matrix, in the pieces' order."""
        return [o for part in self._o_parts() for o in part.unbind(0)]

    def update_amax(self) -> Tensor:
        """This rank's rows' largest |adjusted lr · O| of the last step (0-d fp32), formed when asked
        (telemetry reads it between steps; ``_back``, and O for the own rows where the replies go
        direct, hold the last step's rows of O until then)."""
        if not self._back.numel() or self._amax_lr is None:
            return torch.zeros((), device=self.device)
        held = [t.abs().amax() for t in self._o_parts() if t.numel()]
        return torch.stack(held).amax().float() * self._amax_lr


def orthogonalize(x: Tensor, h: MuonHyper) -> Tensor:
    """NS of a batch x (B, m, n) bf16, m <= n, on its own, as one process's torch path runs it."""
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return iterate(x / norm.clamp(min=h.eps), h.schedule) if len(x) else x


class GatheredMuonBatch:
    """Same-shape DTensor matrices of one group, dtype, mesh and placements whose rows are not split
    on one mesh dim alone (tensor parallelism's column split ``Shard(1)``, or FSDP2 + TP's 2-D
    layouts): every rank gathers each whole matrix (``full_tensor``: an all-gather per split mesh
    dim), runs NS on the batch and keeps its own part of O. NS runs on every rank of the mesh, and
    the gathers are one per matrix, not one per batch: the owner scheme of ``ShardedMuonBatch``
    needs whole rows on each rank."""

    def __init__(self, params: list[DTensor], bufs: list[DTensor]) -> None:
        self.params, self.bufs = params, bufs
        self.local_params = [local(p) for p in params]
        self.local_bufs = [local(b) for b in bufs]
        self.device, self.dtype = self.local_params[0].device, params[0].dtype
        self.rows, self.cols = params[0].shape[0], math.prod(params[0].shape[1:])
        self.tall = self.rows > self.cols
        self.owned = list(range(len(params)))  # every rank orthogonalizes every matrix
        m, n = sorted((self.rows, self.cols))
        self.x = torch.empty((len(params), m, n), dtype=torch.bfloat16, device=self.device)
        self.norm = torch.empty(len(params), dtype=torch.float32, device=self.device)
        self._amax = torch.zeros((), device=self.device)

    def send(self, h: MuonHyper, exchange: bool = True) -> None:
        """The momentum of this rank's part, then NS's bf16 input gathered whole into ``x`` and its
        norms (as ``ShardedMuonBatch``; the gathers wait here, whatever ``exchange``)."""
        grads = checked_grads(self.params)
        torch._foreach_lerp_(self.local_bufs, grads, 1 - h.momentum)
        updates = torch._foreach_lerp(grads, self.local_bufs, h.momentum) if h.nesterov else self.local_bufs
        for i, (p, u) in enumerate(zip(self.params, updates, strict=True)):
            part = DTensor.from_local(u.to(torch.bfloat16), p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())  # fmt: skip
            full = part.full_tensor().reshape(self.rows, self.cols)
            self.x[i].copy_(full.mT if self.tall else full)
        self.norm.copy_(torch.linalg.vector_norm(self.x, dim=(-2, -1)).float().clamp_(min=h.eps_bf16))

    def receive(self, h: MuonHyper) -> None:
        """Nothing: ``send`` waited for its gathers."""

    def before_ns(self, eps_bf16: float) -> None:
        """Nothing: ``send`` formed ``x`` and its norms."""

    def after_ns(self, ortho: Tensor) -> None:
        """Nothing: ``reply`` applies the update from O."""

    def orthogonalize(self, h: MuonHyper) -> Tensor:
        return orthogonalize(self.x, h)

    def reply(self, h: MuonHyper, ortho: Tensor, exchange: bool = True) -> None:
        """Weight decay and the update on this rank's part of each matrix, cut from the whole O
        (nothing to exchange)."""
        step_lr = adjusted_lr(h.lr, h.adjust_lr_fn, self.rows, self.cols)
        full = (ortho.mT if self.tall else ortho).reshape(len(self.params), *self.params[0].shape)
        mine = [local_part(o, p) for o, p in zip(full.unbind(0), self.params, strict=True)]
        torch._foreach_mul_(self.local_params, 1 - h.lr * h.weight_decay)
        torch._foreach_add_(self.local_params, mine, alpha=-step_lr)
        self._amax = torch.stack([o.abs().amax() for o in mine]).max().float() * step_lr

    def apply(self, h: MuonHyper) -> None:
        """Nothing: ``reply`` applied the update."""

    def update_amax(self) -> Tensor:
        """This rank's part's largest |adjusted lr · O| of the last step (0-d fp32)."""
        return self._amax


class ShardedMuonGroupPlan:
    """The sharded batches of one Muon group's DTensor params with grads; on CUDA the owners' NS
    iterations of the batches of a device run together, as one process's do (``plan.JointNS``).

    The batches are split in up to ``stages`` runs of NS of about equal work, in order, so that
    the all-to-alls of one stage move while another's NS runs: every batch's all-to-all to the
    owners starts at once, stage k's NS waits only for its own, and its replies start before
    stage k + 1's NS (on CUDA the collectives run on NCCL's stream; the compute stream waits for
    a collective only where its result is read). ``stages = 1``: one NS run for all, as before.

    ``pair_stages = True`` (on the class) cuts the stages by ``paired_stages`` instead (the fewest
    NS launches: a stage's batches two a launch), and the batches are sent in the stages' order.
    Off: on two H200s at 123M, with its stages' own tuned keys, no faster on the GPU than the runs
    above (benchmarks/results/bench_dist/muon_exchange_w2.md).
    ``coalesce = True`` (the default) issues a stage's all-to-alls each way as one NCCL group
    (``_exchange``): one launch and one work for the stage where each batch's cost 28-66 us of
    host time (on two H200s at 123M the step's GPU time 1.787 -> 1.776 ms, kernels 90 -> 86).

    ``owner_scheme = False`` (on the class) puts row-split batches on the gathered scheme too:
    every rank gathers and orthogonalizes every matrix (the same bits; benchmarks/bench_dist.py's
    baseline for the owner scheme's traffic and NS work)."""

    owner_scheme = True
    stages = 2
    pair_stages = False
    light_last = False  # with pair_stages: of the cuts with the fewest launches, the lightest last stage
    coalesce = True

    def __init__(self, key: tuple, params: list[DTensor], state: dict) -> None:
        self.key = key
        self._hyper: MuonHyper | None = None  # this step's, from send to finish
        self._pending: list = []  # the batches whose replies are in flight (start -> finish)
        batches: dict[tuple, list[DTensor]] = {}
        for p in params:
            if p.is_complex():  # torch.optim.Muon's error
                raise RuntimeError(f"Muon does not support complex parameters (shape {tuple(p.shape)})")
            init_momentum_buffer(p, state[p])
            rows = row_shard_group(p) if self.owner_scheme else None
            layout = ("rows", id(rows[0])) if rows else ("gathered", id(p.device_mesh), tuple(p.placements))
            batches.setdefault((tuple(p.shape), p.dtype, local(p).device, layout), []).append(p)
        mode = backend_mode()
        self.batches = [ShardedMuonBatch(ps, [state[p]["momentum_buffer"] for p in ps], mode) if key[3][0] == "rows"
                        else GatheredMuonBatch(ps, [state[p]["momentum_buffer"] for p in ps])
                        for key, ps in batches.items()]  # fmt: skip
        self.staged = []  # (batches, their OwnerNS runs) per stage
        stages = (paired_stages(self.batches, self.stages, self.light_last) if self.pair_stages
                  else split_in_stages(self.batches, self.stages))  # fmt: skip
        self.batches = [b for stage in stages for b in stage]  # sent in stage order: the first stage's first
        for stage in stages:
            joint: dict[torch.device, list] = {}
            for b in stage:
                if b.owned and ns_on_triton(b.x):
                    joint.setdefault(b.device, []).append(b)
                    b.graphed = True
            self.staged.append((stage, [OwnerNS(bs) for bs in joint.values()]))

    @property
    def joint(self) -> list[OwnerNS]:
        """Every stage's joint NS runs."""
        return [ns for _, runs in self.staged for ns in runs]

    def send(self, group: dict) -> None:
        """The momentum of every batch's rows and their all-to-alls to the owners, left moving:
        the caller may issue other work (the AdamW groups' steps) before ``start`` waits for the
        first stage's."""
        h = self._hyper = MuonHyper(group)
        # every exchange to the owners starts now, in the same order on every rank
        for k, (stage, _) in enumerate(self.staged):
            self._exchange(stage, lambda b, exchange: b.send(h, exchange), ShardedMuonBatch.to_owners, 2 * k)

    def start(self) -> None:
        """The stages' NS up to the last stage's replies, which are left moving: the caller may
        issue other work before ``finish`` applies them. Every stage's replies are issued before
        the stage before it is applied, so each moves under the next stage's NS (the first
        stages) or under the caller's work and ``finish`` (the last)."""
        h = self._hyper
        self._pending = []
        for k, (stage, runs) in enumerate(self.staged):
            for batch in stage:
                with on_device(batch.device):
                    batch.receive(h)
            orthos = {}
            for ns in runs:
                with on_device(ns.batches[0].device):
                    orthos.update(zip(map(id, ns.batches), ns(h.schedule, h.eps_bf16)[0], strict=True))
            for batch in stage:  # NS of the batches no joint run took (CPU: torch's ops)
                if id(batch) not in orthos:
                    with on_device(batch.device):
                        orthos[id(batch)] = batch.orthogonalize(h)
            # the replies move while the next stage's NS runs
            self._exchange(stage, lambda b, exchange, o=orthos: b.reply(h, o[id(b)], exchange),
                           ShardedMuonBatch.to_ranks, 2 * k + 1)  # fmt: skip
            self._apply(self._pending)
            self._pending = stage

    def finish(self) -> None:
        """The last stage's update, once its replies are back (after ``start``)."""
        self._apply(self._pending)
        self._pending = []

    def _exchange(self, stage: list, prepare, exchange, channel: int) -> None:
        """``prepare(batch, exchange)`` for each batch of a stage in order, each issuing its own
        all-to-all; with ``coalesce``, the NCCL batches' (``ShardedMuonBatch.nccl``) are issued
        after the stage's last ``prepare`` as one NCCL group per process group (one launch, one
        work: ``torch.distributed``'s coalescing manager), the others' as before. Batches with
        ``peer_copies``: their copies together, then one flag each way per peer on ``channel``
        (one per stage and way, so that no flag is raised twice before it is seen)."""
        together: dict[tuple, list[ShardedMuonBatch]] = {}
        copied: dict[tuple, list[ShardedMuonBatch]] = {}
        for batch in stage:
            peers = isinstance(batch, ShardedMuonBatch) and batch._peer_copies is not None
            joined = not peers and self.coalesce and isinstance(batch, ShardedMuonBatch) and batch.nccl \
                and batch.world > 1  # fmt: skip
            with on_device(batch.device):
                prepare(batch, not (joined or peers))
            if joined or peers:
                (copied if peers else together).setdefault((batch.group, batch.device), []).append(batch)
        for (_, device), batches in copied.items():
            first = batches[0]
            others = [r for r in range(first.world) if r != first.rank]
            with on_device(device):
                arrival = _PEER_STREAMS.exchange(first._peer_copies[0], others, channel,
                                                 lambda bs=batches: [exchange(b) for b in bs], device)  # fmt: skip
            for batch in batches:  # each waits for the stage's copies and flags (``receive``, ``apply``)
                batch._work = arrival
        for (group, device), batches in together.items():
            with on_device(device), _coalescing_manager(group, device, async_ops=True) as works:
                for batch in batches:
                    exchange(batch)
            for batch in batches:  # each waits for the group's work (``receive``, ``apply``)
                batch._work = works

    def _apply(self, batches: list) -> None:
        for batch in batches:
            with on_device(batch.device):
                batch.apply(self._hyper)

    def update_amax(self) -> Tensor:
        if not self.batches:
            return torch.zeros(())
        device = self.batches[0].device
        return torch.stack([b.update_amax().to(device) for b in self.batches]).max()


_PEER_STREAMS = peer_copy.PeerStreams()  # the side streams of the peer copies, per device


class OwnerNS(JointNS):
    """The NS iterations of one device's owner batches of a stage (``JointNS``), with each batch's
    ``before_ns`` (the received rows into its matrices, their norms) and ``after_ns`` (O's pieces
    into the reply buffer) in the same CUDA graph: their buffers are static too, so one replay
    takes the copies and norms that would otherwise be launched one by one from the host."""

    eps_bf16 = 0.0

    def __call__(self, schedule: list[tuple[float, float, float]], eps_bf16: float) -> tuple[list[Tensor], bool]:
        self.eps_bf16 = eps_bf16
        return super().__call__(schedule)

    def _run(self, schedule: list[tuple[float, float, float]]) -> list[Tensor]:
        for b in self.batches:
            b.before_ns(self.eps_bf16)
        orthos = super()._run(schedule)
        for b, ortho in zip(self.batches, orthos, strict=True):
            b.after_ns(ortho)
        return orthos

    def _key(self) -> tuple:
        return (self.eps_bf16,)


def split_in_stages(batches: list, stages: int) -> list[list]:
    """``batches`` in order, cut into at most ``stages`` non-empty consecutive runs, each cut where
    the work before it comes nearest to its share of the whole (``_ns_work``: counted over all
    ranks' matrices, so that every rank cuts at the same batches). A batch is never split."""
    prefix = [0]
    for b in batches:
        prefix.append(prefix[-1] + _ns_work(b))
    cuts = [0]
    for k in range(1, min(stages, len(batches))):
        target = prefix[-1] * k / stages
        last = len(batches) - (min(stages, len(batches)) - k)  # leave a batch for each later stage
        cuts.append(min(range(cuts[-1] + 1, last + 1), key=lambda i: abs(prefix[i] - target)))
    cuts.append(len(batches))
    return [batches[i:j] for i, j in itertools.pairwise(cuts) if j > i]


def _ns_work(batch) -> int:
    """A batch's NS work over all ranks' matrices: matrices x m² n for NS on m x n, m <= n (its
    products' FLOPs up to a constant)."""
    return len(batch.params) * batch.x.shape[-2] ** 2 * batch.x.shape[-1]


def paired_stages(batches: list, stages: int, light_last: bool = False) -> list[list]:
    """``batches`` cut into at most ``stages`` non-empty stages with the fewest NS launches, then
    the least work in the largest stage (``light_last``: the least in the last stage, whose
    replies no later NS hides, then in the largest). Each of NS's products runs a stage's batches two a launch
    (``newton_schulz_launch._hopper_pairs``), so a stage of k batches takes ceil(k / 2) launches a
    product, and a batch left alone pays a launch's latency however small it is (on a 123M model's
    owner the 12 k and v matrices of 192 x 768 took 21 us of launches an iteration, for about 1%
    of the work, beside two others in a run). Work: ``_ns_work``. Every cut of
    up to ``PAIRED_MAX`` batches is tried (Stirling numbers: 511 cuts of 10 batches in 2 stages);
    more take ``split_in_stages``. Stages are ordered by their first batch in ``batches`` and keep
    that order within; ties go to the first cut in that order, so every rank cuts alike."""
    count = min(stages, len(batches))
    if len(batches) > PAIRED_MAX or count <= 1:
        return split_in_stages(batches, stages)
    work = [_ns_work(b) for b in batches]

    def cost(labels: tuple[int, ...]) -> tuple:
        members = [[i for i, s in enumerate(labels) if s == k] for k in range(count)]
        loads = [sum(work[i] for i in m) for m in members]
        return sum(-(-len(m) // 2) for m in members), loads[-1] if light_last else 0, max(loads), labels

    best = min(_stage_labels(len(batches), count), key=cost)
    return [[b for b, s in zip(batches, best, strict=True) if s == k] for k in range(count)]


PAIRED_MAX = 10


def _stage_labels(n: int, count: int):
    """Every cut of n items into ``count`` non-empty stages, as a tuple of stage labels per item
    numbered in order of first appearance (restricted growth strings: each cut once)."""

    def grow(labels: list[int], used: int):
        left = n - len(labels)
        if left == 0:
            if used == count:
                yield tuple(labels)
            return
        for k in range(min(used + 1, count)):
            if count - max(used, k + 1) <= left - 1:  # enough items left to open the stages still empty
                yield from grow([*labels, k], max(used, k + 1))

    yield from grow([], 0)


def sharded_muon_group_plan(plans: dict, index: int, params: list[DTensor], state: dict) -> ShardedMuonGroupPlan:
    """The cached sharded plan of Muon group ``index``, rebuilt when the params with grads change."""
    key = tuple(map(id, params))
    plan = plans.get(("sharded", index))
    if plan is None or plan.key != key:
        plan = plans[("sharded", index)] = ShardedMuonGroupPlan(key, params, state)
    return plan
