"""How fast two GPUs of one host swap a buffer, and what each way of moving it costs the work beside
it: NCCL's all-to-all (as sharded Muon issues it: nothing to or from the rank itself) against
copy-engine writes into the peer's symmetric memory (``torch.distributed._symmetric_memory``: the
peer's buffer mapped here, ``copy_`` into it, then a signal each way), each alone, beside a
512 MB device copy on the compute stream (contention for HBM) and beside 20 batched products of
NS's shape, (6, 768, 2048) @ (6, 2048, 768) bf16 (contention for SMs).

    torchrun --nproc_per_node 2 benchmarks/exchange_rates.py [--out FILE.md]

Times are GPU microseconds from one rank's events (medians of 12), the streams of both ranks
lined up before each run by a sleep and an all-reduce (as ``dist_step_profile.py``); "moved" is
the bytes each rank sends to the other. Two ranks only (the copy-engine writes pair each rank
with one peer).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

SIZES_MB = (4, 14, 28)
PAIRS = 20  # batched products beside the exchange
HOLD_CYCLES = 20_000_000  # ~10 ms at 2 GHz: the host issues the whole run before the GPU starts it


def timed(fn: Callable[[], None], marker: torch.Tensor, iters: int = 12) -> float:
    """Median GPU time (us) of ``fn`` on this rank, every rank's stream released together."""
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        dist.all_reduce(marker)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def pattern(n: int, rank: int, device: torch.device) -> torch.Tensor:
    """(n,) bf16 values exact in bf16 that differ by rank, to check what arrived."""
    return (torch.arange(n, device=device) % 64 + 64 * rank).to(torch.bfloat16)


def exchanges(n: int, rank: int, peer: int, device: torch.device, side: torch.cuda.Stream) -> dict[str, tuple]:
    """name -> (exchange(work): n bf16 elements to the peer and n from it, ``work()`` issued on the
    compute stream meanwhile; the buffer the peer's elements arrive in)."""
    import torch.distributed._symmetric_memory as symm_mem

    send = pattern(n, rank, device)
    got = torch.empty_like(send)
    splits = [0 if r == rank else n for r in range(2)]
    recv = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(recv, group=dist.group.WORLD.group_name)
    remote = handle.get_buffer(peer, (n,), torch.bfloat16)

    def nccl(work: Callable[[], None]) -> None:
        done = dist.all_to_all_single(got, send, output_split_sizes=splits, input_split_sizes=splits,
                                      async_op=True)  # fmt: skip
        work()
        done.wait()

    def copy_engine(work: Callable[[], None]) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            remote.copy_(send)  # a device-to-device memcpy into the peer's mapped buffer
            handle.put_signal(peer)  # written: tell the peer ...
            handle.wait_signal(peer)  # ... and wait for its write to this rank
        work()
        torch.cuda.current_stream().wait_stream(side)

    return {"NCCL all-to-all": (nccl, got), "copy engine": (copy_engine, recv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the table here too (markdown)")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"exchange_rates.py runs on 2 ranks, got {world}")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    peer = 1 - rank
    marker = torch.zeros(1, device=device)
    big = torch.empty(2**27, device=device)  # 512 MB fp32
    big_out = torch.empty_like(big)
    a = torch.randn(6, 768, 2048, device=device, dtype=torch.bfloat16)
    b = torch.randn(6, 2048, 768, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)
    beside = {"alone": lambda: None, "512 MB copy": lambda: big_out.copy_(big),
              f"{PAIRS} bmm": lambda: [torch.bmm(a, b) for _ in range(PAIRS)]}  # fmt: skip
    rows = []
    for mb in SIZES_MB:
        n = mb * 2**20 // 2
        for name, (exchange, arrived) in exchanges(n, rank, peer, device, side).items():
            arrived.zero_()
            torch.cuda.synchronize()
            dist.barrier()  # both zeroed before either writes
            exchange(lambda: None)
            torch.cuda.synchronize()
            if not torch.equal(arrived, pattern(n, peer, device)):
                raise RuntimeError(f"{name}: the peer's {mb} MB did not arrive intact")
            times = {k: timed(lambda ex=exchange, w=w: ex(w), marker) for k, w in beside.items()}
            rows.append((mb, name, times))
    work_alone = {k: timed(w, marker) for k, w in beside.items() if k != "alone"}
    if rank == 0:
        head = ["moved MB", "how", "alone us", "GB/s", *(f"beside {k} us" for k in work_alone)]
        lines = [f"2 ranks, {torch.cuda.get_device_name(device)}; " + ", ".join(
            f"{k} alone {v:.1f} us" for k, v in work_alone.items()), "",  # fmt: skip
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
        for mb, name, t in rows:
            cells = [str(mb), name, f"{t['alone']:.1f}", f"{mb * 2**20 / t['alone'] / 1e3:.0f}",
                     *(f"{t[k]:.1f}" for k in work_alone)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
