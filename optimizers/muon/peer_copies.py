"""Sharded Muon's two exchanges as copies into the peers' buffers, for shard groups on one host.

NCCL's all-to-all moves the pieces with its own kernels: beside an HBM-bound kernel (the momentum
and AdamW launches the first exchange runs under) it slows to a fraction of its rate, and while it
runs the owner's NS kernels wait for the SMs it holds (``benchmarks/exchange_rates.py``,
``benchmarks/results/bench_dist/muon_owner_kernels_w2.md``). Here each rank's receive and return
buffers live in one symmetric allocation (``torch.distributed._symmetric_memory``: every rank's
allocation mapped on the others), a rank writes its pieces straight into the peers' buffers by
device-to-device copies (memcpy, run by the copy engines, no SMs), then raises a flag on each peer
and waits for each peer's flag (the signal pads' ``put_signal`` / ``wait_signal``).

``piece_offsets`` lays the pieces out exactly as the all-to-alls do (``ShardedMuonBatch``): the
same buffers hold the same elements either way.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket

import torch
import torch.distributed as dist
from torch import Tensor


def piece_offsets(world: int, n_params: int, heres: list[int], cols: int) -> tuple[list[list[int]], ...]:
    """Where each rank's pieces go in a batch of ``n_params`` matrices of ``cols`` columns split
    by rows over ``world`` ranks (rank s holds ``heres[s]`` rows of each; matrix j belongs to
    owner j mod world). Returns (sizes, sent_at, got_at), lists of lists of element counts:
    ``sizes[s][r]`` elements go from rank s to owner r (none to itself); they start at
    ``sent_at[s][r]`` in s's send buffer of the other owners' pieces (owner by owner in rank
    order; O's rows come back to the same place) and at ``got_at[r][s]`` in r's receive buffer
    (rank by rank; r's reply to s is read from there)."""
    owned = [len(range(r, n_params, world)) for r in range(world)]
    sizes = [[0 if r == s else owned[r] * heres[s] * cols for r in range(world)] for s in range(world)]
    sent_at = [list(itertools.accumulate(row, initial=0))[:-1] for row in sizes]
    got_at = [list(itertools.accumulate((sizes[s][r] for s in range(world)), initial=0))[:-1] for r in range(world)]
    return sizes, sent_at, got_at


# A flag not seen in this long ends the process (the signal kernels trap) rather than hanging it;
# long enough for a peer's first step, which may compile its kernels before it copies
SIGNAL_TIMEOUT_MS = 300_000


class SymmetricPool:
    """(numel,) bf16 on every rank of ``group`` (a CUDA device each, one host), each rank's mapped
    on the others: ``local`` (zeros when built), ``remote(peer)`` (a tensor on this device that is
    the peer's ``local``; a ``copy_`` into it is a memcpy the copy engines run), and flags
    (``put`` on a peer, ``wait`` for a peer's, by channel; ``wait`` resets the flag it saw).
    Peers are ranks in ``group``. Built collectively: every rank of the group, in the same order."""

    def __init__(self, numel: int, device: torch.device, group: dist.ProcessGroup) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"ShardedMuonBatch.peer_copies needs the shard group's matrices on CUDA devices of "
                               f"one host, got {device}; leave it off there (the all-to-alls)")  # fmt: skip
        import torch.distributed._symmetric_memory as symm_mem

        # the pool needs no NVLink multicast object, which rendezvous creates where the GPUs support
        # it unless this is set (and fails on some GPUs that report it): set it unless already chosen
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.local = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
        # zeroed before any peer can see it: a peer writes as soon as its rendezvous returns
        self.local.zero_()
        torch.cuda.current_stream(device).synchronize()
        self._handle = symm_mem.rendezvous(self.local, group.group_name)
        self._shape = (numel,)

    def remote(self, peer: int) -> Tensor:
        return self._handle.get_buffer(peer, self._shape, torch.bfloat16)

    def put(self, peer: int, channel: int) -> None:
        self._handle.put_signal(peer, channel, SIGNAL_TIMEOUT_MS)

    def wait(self, peer: int, channel: int) -> None:
        self._handle.wait_signal(peer, channel, SIGNAL_TIMEOUT_MS)


def copy_blocks(dst: Tensor, src: Tensor) -> None:
    """``dst[k] = src[k]`` for (B, rows, C) tensors of one dtype whose blocks ``[k]`` are each
    contiguous (strides (any, C, 1)): a block of rows of each of B matrices, as a rank's rows of
    the owned matrices are in O. On CUDA one pitched copy on the current stream (a block a row of
    ``cudaMemcpy2DAsync``: the copy engines run it, no SMs, and a peer's mapped buffer is a
    destination like any other); elsewhere, or where torch's CUDA runtime cannot be called (linked
    statically), torch's ``copy_`` block by block."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() != 3:
        raise ValueError(f"copy_blocks: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} {src.dtype} "
                         f"must be (B, rows, C) of one shape and dtype")  # fmt: skip
    for name, t in (("dst", dst), ("src", src)):
        if t.shape[1] > 1 and t.stride(1) != t.shape[2] or t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"copy_blocks: {name}'s blocks must be contiguous rows, got strides {t.stride()}")
    memcpy_2d = _memcpy_2d() if dst.device.type == "cuda" and dst.numel() else None
    if memcpy_2d is None:
        for to, block in zip(dst, src, strict=True):
            to.copy_(block)
        return
    size = dst.element_size()
    width = dst.shape[1] * dst.shape[2] * size
    pitch = lambda t: t.stride(0) * size if t.shape[0] > 1 else width  # noqa: E731 (one block: any stride)
    # the current stream's raw handle (``torch.cuda.current_stream(...).cuda_stream`` less the Stream
    # object it builds: 4-8 us of host time a call on an H200 machine, eight calls a step)
    stream = torch._C._cuda_getCurrentRawStream(dst.device.index)
    code = memcpy_2d(dst.data_ptr(), pitch(dst), src.data_ptr(), pitch(src), width, dst.shape[0], _MEMCPY_DEFAULT,
                     stream)  # fmt: skip
    if code:
        raise RuntimeError(f"copy_blocks: cudaMemcpy2DAsync returned CUDA error {code}")


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_CUDART: list = []


def _memcpy_2d():
    """``cudaMemcpy2DAsync`` of the CUDA runtime that torch loaded (found in this process's mapped
    files; torch's Python API has no pitched copy), or None where none is mapped (a static one)."""
    if not _CUDART:
        fn = None
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path is not None:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        _CUDART.append(fn)
    return _CUDART[0]


POOL = SymmetricPool  # what ``ShardedMuonBatch`` builds its pools with (tests put a CPU stand-in here)

_DIRECT: dict[str, bool] = {}  # by group name: its answer, asked once


def direct_peers(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the pool can map every rank's buffer on every other: all ranks of ``group`` on this
    host, each on a CUDA device of its own that this process sees (``device`` here), with peer
    access to the others' (NVLink or PCIe peer-to-peer). Each rank checks its own pairs and all
    take the answer only if every rank said yes, so that they agree. Collective the first time
    per group (two ``all_gather_object`` calls: every rank of the group asks, in the same order),
    cached by the group's name."""
    name = group.group_name
    if name not in _DIRECT:
        world = dist.get_world_size(group)
        index = device.index if device.index is not None else torch.cuda.current_device()
        seen: list = [None] * world
        dist.all_gather_object(seen, (socket.gethostname(), index), group=group)
        others = [i for _, i in seen if i != index]
        mine = (len({host for host, _ in seen}) == 1 and len(others) == world - 1
                and all(torch.cuda.can_device_access_peer(index, i) for i in others))  # fmt: skip
        answers: list = [None] * world
        dist.all_gather_object(answers, mine, group=group)
        _DIRECT[name] = all(answers)
    return _DIRECT[name]


def takes_peer_copies(setting: bool | str, world: int, nccl: bool, device: torch.device,
                      group: dist.ProcessGroup) -> bool:  # fmt: skip
    """Whether a batch whose shard group is ``group`` (``world`` ranks, ``nccl`` its backend's)
    exchanges by peer copies, for ``ShardedMuonBatch.peer_copies = setting``: never on one rank;
    "auto" where the group is two NCCL ranks whose GPUs reach each other (``direct_peers``); True
    always, where on CUDA devices those must reach each other (a RuntimeError otherwise, rather
    than a failure inside the pool's rendezvous; on CPU devices only ``POOL``'s stand-in builds).
    Raises ValueError for a setting other than True, False or "auto". Collective where it asks
    ``direct_peers``: every rank of the group calls it with the same setting."""
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"ShardedMuonBatch.peer_copies must be True, False or 'auto', got {setting!r}")
    if world < 2 or setting is False:
        return False
    if device.type != "cuda":
        return setting is True
    if setting == "auto":
        return world == 2 and nccl and direct_peers(group, device)
    if not direct_peers(group, device):
        raise RuntimeError("ShardedMuonBatch.peer_copies = True needs the shard group's GPUs on one host, one each, "
                           "with peer access between them; set it to 'auto' or False (the all-to-alls)")  # fmt: skip
    return True


class PeerStreams:
    """A device's two side streams for the copies: one issues the copies and the flags they raise,
    the other waits for the peers' flags (a waiting kernel there holds up nothing but the
    consumers, which wait for its event)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def exchange(self, pool: SymmetricPool, peers: list[int], channel: int, copy,
                 device: torch.device) -> torch.cuda.Event | None:  # fmt: skip
        """``copy()`` (the stage's copies), then a flag on each of ``peers`` and a wait for each
        one's on ``channel``; on CUDA on the side streams after the current stream's work so far,
        returning the event a consumer's stream waits for (``wait()``): the waits follow this
        rank's copies on their stream, so it covers both the peers' pieces in and this rank's
        send buffer free again; elsewhere at once (returns None)."""
        if device.type != "cuda":
            copy()
            for peer in peers:
                pool.put(peer, channel)
            for peer in peers:
                pool.wait(peer, channel)
            return None
        if device not in self._streams:
            # high priority: the one-block flag kernels start as soon as an SM frees, instead of
            # queueing behind every block of an SM-filling update kernel the copies ran beside
            self._streams[device] = (torch.cuda.Stream(device, priority=-1), torch.cuda.Stream(device, priority=-1))
        copies, waits = self._streams[device]
        copies.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copies):
            copy()
            for peer in peers:
                pool.put(peer, channel)
        waits.wait_stream(copies)
        with torch.cuda.stream(waits):
            for peer in peers:
                pool.wait(peer, channel)
            arrived = torch.cuda.Event()
            arrived.record()
        return arrived
