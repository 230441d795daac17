"""``DistributedAdamW`` on the probe model (``fsdp_probe``), run on each rank: its steps against
one process's AdamW on the averaged gradients, with and without gradient accumulation."""

from __future__ import annotations

import os

import torch
from distributed import use_gpu
from fsdp_probe import Probe, shard_of, targets

from kernel_factory.optimizers import AdamW, DistributedAdamW
from kernel_factory.optimizers.adamw.distributed import _pipeline

HYPER = dict(lr=1e-2, weight_decay=0.1)
TINY_BUCKETS = 1e-4  # MiB: a few parameters per bucket, so that several reduce-scatters go out


def _device_setup(device: str) -> None:
    if device == "cuda":
        use_gpu()


def micro_targets(step: int, micro: int, rank: int, world: int, device: str) -> list[torch.Tensor]:
    return targets(step * 8 + micro, rank, world, device)


def zero_equal_to_one_process(rank: int, world: int, backend: str, device: str = "cpu", micro: int = 1,
                              pipelined: bool = True) -> None:  # fmt: skip
    """4 steps of ``micro`` backward passes each (all but the last inside ``no_sync``): parameters
    and state shards bitwise those of one process on the averaged summed gradients, with the
    pipelined step (three launches) or the single launch (``DistributedAdamW.pipelined_step``)."""
    os.environ["KERNEL_FACTORY_BACKEND"] = backend
    DistributedAdamW.pipelined_step = pipelined
    _device_setup(device)
    model = Probe().to(device)
    opt = DistributedAdamW(model.parameters(), bucket_cap_mb=TINY_BUCKETS, **HYPER)
    assert len(opt._grads.buckets) > 1
    ref = Probe().to(device)
    ref_opt = AdamW(ref.parameters(), **HYPER)
    for step in range(4):
        for m in range(micro):
            if m < micro - 1:
                with opt.no_sync():
                    model(micro_targets(step, m, rank, world, device)).backward()
            else:
                model(micro_targets(step, m, rank, world, device)).backward()
            assert all(p.grad is None for p in model.parameters()) == (m == micro - 1)
        opt.step()
        opt.zero_grad()
        for i, p in enumerate(ref.params):
            p.grad = sum(micro_targets(step, m, 0, 1, device)[i] for m in range(micro))
        ref_opt.step()
    for i, (p, q) in enumerate(zip(model.params, ref.params, strict=True)):
        assert torch.equal(p, q), i
        for key in ("step", "exp_avg", "exp_avg_sq"):
            ours, theirs = opt.state[p][key], ref_opt.state[q][key]
            ours = ours.to_local() if key != "step" else ours
            assert torch.equal(ours, theirs if key == "step" else shard_of(theirs, rank, world)), (i, key)


def zero_clips_like_one_process(rank: int, world: int) -> None:
    """``DistributedAdamW.clip_grad_norm_`` against torch's clip on the averaged gradients in one
    process: the same norm up to the summation order (log2(n) ulps), then the same step."""
    os.environ["KERNEL_FACTORY_BACKEND"] = "triton"
    model, ref = Probe(), Probe()
    opt = DistributedAdamW(model.parameters(), bucket_cap_mb=TINY_BUCKETS, **HYPER)
    ref_opt = AdamW(ref.parameters(), **HYPER)
    rtol = 8 * torch.finfo(torch.float32).eps
    for step in range(3):
        model(targets(step, rank, world)).backward()
        total = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        for p, g in zip(ref.params, targets(step, 0, 1), strict=True):
            p.grad = g
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        torch.testing.assert_close(total, expected, rtol=rtol, atol=0)
    for p, q in zip(model.params, ref.params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)


def _steps_side_by_side(models: tuple, opts: tuple, rank: int, device: str, check) -> torch.Tensor:
    """3 training steps of each (model, optimizer) on the same random batches (4, 8), ``check()``
    after each; returns the last batch."""
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen).to(device)
        for model, opt in zip(models, opts, strict=True):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        check()
    return x


def zero_gathers_in_forward(rank: int, world: int, device: str = "cpu") -> None:
    """``gather_in_forward``: 3 steps bitwise those of the all-gathers finished in ``step()``; between
    a step and the next forward the gathers are in flight, a layer's forward finishes its own
    buckets', and the model's ``state_dict()`` finishes the rest."""

    _device_setup(device)

    def stack() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4))).to(device)

    eager, deferred = stack(), stack()
    opts = (DistributedAdamW(eager.parameters(), bucket_cap_mb=TINY_BUCKETS, **HYPER),
            DistributedAdamW(deferred.parameters(), bucket_cap_mb=TINY_BUCKETS, gather_in_forward=[*deferred, deferred],
                             **HYPER))  # fmt: skip

    def in_flight() -> None:
        assert not opts[0]._grads.pending and len(opts[1]._grads.pending) == len(opts[1]._grads.buckets)

    x = _steps_side_by_side((eager, deferred), opts, rank, device, in_flight)
    grads = opts[1]._grads
    first = {id(b) for b in grads.buckets_of(list(deferred[0].parameters()))}
    deferred[0](x)
    assert grads.pending and not first & set(grads.pending)
    state = deferred.state_dict()
    assert not grads.pending
    for (name, p), q in zip(eager.state_dict().items(), state.values(), strict=True):
        assert torch.equal(p, q), name


def zero_gathers_in_the_forward_order(rank: int, world: int, device: str = "cpu") -> None:
    """``gather_in_forward`` with a model whose own hook fires first and holds its last parameters
    (an output head, as a language model's): after the first forward the all-gathers go out in
    the order the hooks ask for them, the head's first, not last as parameter order would send
    it; the steps stay those of the eager gathers."""

    _device_setup(device)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
            self.head = torch.nn.Linear(8, 8)  # declared last, listed with the model itself

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    eager, deferred = Net().to(device), Net().to(device)
    opts = (DistributedAdamW(eager.parameters(), bucket_cap_mb=TINY_BUCKETS, **HYPER),
            DistributedAdamW(deferred.parameters(), bucket_cap_mb=TINY_BUCKETS,
                             gather_in_forward=[*deferred.body, deferred], **HYPER))  # fmt: skip
    grads = opts[1]._grads
    units = [deferred.head, *deferred.body]  # the order the hooks ask: the model's (its head) first
    expected = [id(b) for u in units for b in grads.buckets_of(list(u.parameters()))]
    assert expected != [id(b) for b in reversed(grads.buckets)]  # parameter order would differ

    def in_hook_order() -> None:
        assert list(grads.pending) == expected

    _steps_side_by_side((eager, deferred), opts, rank, device, in_hook_order)
    opts[1].wait_params()
    for p, q in zip(eager.parameters(), deferred.parameters(), strict=True):
        assert torch.equal(p, q)


def zero_steps_the_first_gathered_bucket_between_halves(rank: int, world: int) -> None:
    """The bucket the next forward needs first (the first layer's, reduce-scattered last) is
    stepped between the two halves of the others: when its all-gather goes out, the parameters of
    the first half are updated and those of the second half not yet; the other gathers follow."""
    os.environ["KERNEL_FACTORY_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(6)))
    opt = DistributedAdamW(model.parameters(), bucket_cap_mb=TINY_BUCKETS, **HYPER)
    grads = opt._grads
    assert len(grads.buckets) >= 4
    old = [p.detach().clone() for p in model.parameters()]
    seen: list[tuple] = []
    launch = grads.launch_gather

    def record(bucket) -> None:
        moved = {id(p) for p, q in zip(model.parameters(), old, strict=True) if not torch.equal(p, q)}
        seen.append((bucket, moved))
        launch(bucket)

    grads.launch_gather = record
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    first, moved = seen[0]
    assert first is grads.buckets[-1]  # model.0's parameters: backward's last
    assert [b for b, _ in seen[1:]] == list(reversed(grads.buckets[:-1]))
    first_half, _, second_half = _pipeline(grads.buckets, first)
    assert first_half and second_half
    stepped = {id(p) for b in [*first_half, first] for p in b.params}
    assert moved == stepped, (len(moved), len(stepped))
    assert len(seen[-1][1]) == sum(p.numel() > 0 for p in model.parameters())
