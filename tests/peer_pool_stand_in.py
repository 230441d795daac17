"""``peer_copies.SymmetricPool``'s contract on CPU ranks (Gloo): each rank's buffer and flags are
shared files that every rank of the group maps, so a ``copy_`` into a peer's view lands in the
peer's memory and a flag is a shared int32 that the waiter spins on. Sharded Muon's exchange by
peer copies (offsets, flags per stage and way, the order of copies and waits) then runs end to end
without GPUs."""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

CHANNELS = 64  # flags per peer (a stage and a way each)
TIMEOUT_S = 60.0
POOLS = [0, 0]  # (pools built, flags raised) in this process


class FilePool:
    """As ``SymmetricPool``: ``local``, ``remote(peer)``, ``put(peer, channel)`` and ``wait(peer,
    channel)``, over files named by the job's port, the group's first global rank and the number
    of pools this process built (the same on every rank of a group: all build them in one order)."""

    def __init__(self, numel: int, device: torch.device, group: dist.ProcessGroup) -> None:
        assert device.type == "cpu", device
        POOLS[0] += 1
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.world = world
        name = f"kf_pool_{os.environ['MASTER_PORT']}_{dist.get_global_rank(group, 0)}_{POOLS[0]}"
        base = os.path.join(tempfile.gettempdir(), name)
        files = [(f"{base}_{r}", f"{base}_{r}.flags") for r in range(world)]
        self.local = torch.from_file(files[self.rank][0], shared=True, size=numel, dtype=torch.bfloat16)
        self._flags = torch.from_file(files[self.rank][1], shared=True, size=CHANNELS * world, dtype=torch.int32)
        dist.barrier(group=group)  # every rank's files exist
        self._remote = {r: torch.from_file(files[r][0], shared=True, size=numel, dtype=torch.bfloat16)
                        for r in range(world) if r != self.rank}  # fmt: skip
        self._remote_flags = {r: torch.from_file(files[r][1], shared=True, size=CHANNELS * world, dtype=torch.int32)
                              for r in range(world) if r != self.rank}  # fmt: skip
        dist.barrier(group=group)  # every rank mapped them: the names can go
        for path in files[self.rank]:
            os.unlink(path)

    def remote(self, peer: int) -> torch.Tensor:
        return self._remote[peer]

    def put(self, peer: int, channel: int) -> None:
        POOLS[1] += 1
        flag = self._remote_flags[peer][channel * self.world + self.rank]
        assert int(flag) == 0, f"flag {channel} from {self.rank} raised again before rank {peer} saw it"
        flag.fill_(1)

    def wait(self, peer: int, channel: int) -> None:
        flag = self._flags[channel * self.world + peer]
        deadline = time.monotonic() + TIMEOUT_S
        while int(flag) != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: no flag {channel} from rank {peer} in {TIMEOUT_S} s")
        flag.fill_(0)
