"""Multi-process tests on one machine: ranks over Gloo on CPU (or CUDA tensors on one GPU).

``run_ranks(world, fn, *args)`` spawns ``world`` processes, each calling ``fn(rank, world,
*args)`` with a Gloo process group up; ``fn`` must be a module-level function. A rank that
raises prints its traceback and exits with 1, which fails the call here. Every rank ends with a
barrier, ``destroy_process_group`` and ``os._exit``: without them Gloo can abort at exit.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":  # one process per GPU, as torchrun lays them out
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    code = 0
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    if code == 0:
        dist.destroy_process_group()
    os._exit(code)


def use_gpu() -> None:
    """This rank's GPU: under NCCL its own (``_rank_main`` set it); under Gloo the one GPU that every
    rank shares (correctness only: NCCL refuses two ranks on one device)."""
    if dist.get_backend() != "nccl":
        torch.cuda.set_device(0)


def run_ranks(world: int, fn, *args, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks (Gloo; ``backend="nccl"`` for one rank per GPU,
    or one rank on the one GPU); raises if any rank failed."""
    # Without a GPU, ranks fork (no re-import of torch and the package: seconds per call); a CUDA
    # parent cannot fork children that use CUDA, so there they spawn.
    method = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(_rank_main, args=(world, _free_port(), fn, args, backend), nprocs=world, join=True,
                       start_method=method)  # fmt: skip
