"""ZeRO-2 gradient and parameter traffic for optimizers over replicated (unwrapped) parameters.

Each rank owns FSDP2's dim-0 shard of every parameter (``row_shards``). Gradients reach the owner
through buckets: a post-accumulate-grad hook copies a parameter's gradient into its bucket's
rank-major send buffer and frees it; a full bucket is reduce-scattered asynchronously while the
rest of backward runs. Buckets are launched in one order on every rank (their index: parameters
in reverse, roughly the order backward produces them), so every rank issues the same collectives.
``launch_rest()`` flushes what backward left (buckets some of whose parameters got no gradient:
their slots are zeros) and a bucket's ``wait()`` gives its parameters' averaged local gradients;
after the optimizer has stepped a bucket's shards, ``launch_gather()`` brings every rank's rows
back into the full parameters.

Like DDP without ``find_unused_parameters``, every rank must produce gradients for the same
parameters in an iteration. Backward passes inside ``no_sync()`` leave gradients in ``.grad`` to
accumulate; a second backward outside it reduces again and the results add up.
"""

from __future__ import annotations

import gc

import torch
from torch import Tensor

from .collectives import all_gather, reduce_scatter_sum
from .row_shards import RowShard


class GradBucket:
    """Same-dtype, same-device parameters whose gradients travel in one reduce-scatter."""

    def __init__(self, params: list[Tensor], shards: list[RowShard]) -> None:
        self.params, self.shards = params, shards
        offset = 0
        for s in shards:
            s.offset, offset = offset, offset + s.padded_numel
        self.piece_numel = offset  # elements per rank
        p = params[0]
        self.world = shards[0].world
        self.reduced = torch.zeros(offset, dtype=p.dtype, device=p.device)  # the averaged local grads
        self.send: Tensor | None = None
        self.ready: set[int] = set()  # ids of params written into ``send`` this round
        self.rounds: list[tuple] = []  # (work, out, send) of launched reduce-scatters not waited on
        self.got: set[int] = set()  # ids of params with a gradient this iteration

    def write(self, p: Tensor, shard: RowShard) -> None:
        if self.send is None:
            self.send = torch.empty(self.world, self.piece_numel, dtype=p.dtype, device=p.device)
        if id(p) in self.ready:  # a second backward before this round went out: add (rare, so unfused)
            extra = torch.zeros_like(self.send)
            shard.scatter_rows(p.grad, extra)
            self.send.add_(extra)
        else:
            shard.scatter_rows(p.grad, self.send)
        self.ready.add(id(p))
        self.got.add(id(p))

    @property
    def full(self) -> bool:
        """Whether every parameter's gradient is in this round's send buffer."""
        return len(self.ready) == len(self.params)

    def launch(self, group) -> None:
        """Reduce-scatter this round's gradients (missing ones as zeros), asynchronously. The first
        round of an iteration reduces into ``reduced``; later ones (gradient accumulation without
        ``no_sync``) into buffers that ``wait`` adds."""
        for p, s in zip(self.params, self.shards, strict=True):
            if id(p) not in self.ready:
                s.slots(self.send).zero_()
        out = torch.empty_like(self.reduced) if self.rounds else self.reduced
        self.rounds.append((reduce_scatter_sum(out, self.send.view(-1), group), out, self.send))
        self.send, self.ready = None, set()

    def wait(self) -> None:
        """Wait for this iteration's reduce-scatters; ``reduced`` = their sum / world (SUM, then an
        explicit divide: the same bits as AVG when world is a power of two, and Gloo has no AVG)."""
        for i, (work, out, _) in enumerate(self.rounds):
            work.wait()
            if i:
                self.reduced.add_(out)
        if self.rounds:
            self.reduced.div_(self.world)
        self.rounds = []


class ZeroGrads:
    """The buckets of an optimizer's parameters, their hooks, and the exchanges of one iteration.

    ``params``: the parameters that require grad, each with its ``RowShard`` in ``shards``;
    ``bucket_numel``: the most elements a bucket's send buffer holds before a new one starts.
    """

    def __init__(self, params: list[Tensor], shards: dict[int, RowShard], group, bucket_numel: int) -> None:
        self.group = group
        self.syncing = True
        self.buckets: list[GradBucket] = []
        current: list[Tensor] = []
        for p in reversed(params):  # backward produces the last layers' gradients first
            numel = sum(shards[id(q)].padded_numel * shards[id(q)].world for q in current)
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or numel + shards[id(p)].padded_numel * shards[id(p)].world > bucket_numel):  # fmt: skip
                self.buckets.append(GradBucket(current, [shards[id(q)] for q in current]))
                current = []
            current.append(p)
        if current:
            self.buckets.append(GradBucket(current, [shards[id(q)] for q in current]))
        self._bucket_of = {id(p): (b, s) for b in self.buckets for p, s in zip(b.params, b.shards, strict=True)}
        self._next = 0  # the next bucket to launch this round: launches go in index order on every rank
        self.pending: dict[int, tuple] = {}  # id(bucket) -> (bucket, work, out, send): deferred all-gathers
        self._asked: dict[int, None] = {}  # ids of buckets forward hooks asked for since the last round, in order
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: Tensor) -> None:
        if not self.syncing:
            return  # no_sync(): the gradient stays in .grad and accumulates
        bucket, shard = self._bucket_of[id(p)]
        bucket.write(p, shard)
        p.grad = None  # ZeRO-2: the full gradient is freed once it is in the bucket
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self.buckets[self._next].launch(self.group)
            self._next += 1
        if self._next == len(self.buckets):
            self._next = 0  # a whole round went out; another backward starts the next

    def launch_rest(self) -> list[GradBucket]:
        """Launch what this round left (buckets with some gradients) and return the buckets that got
        gradients this iteration, in launch order: ``GradBucket.wait`` one before reading its
        ``reduced``, its ``got`` says which parameters. Call ``done()`` after the step."""
        for bucket in self.buckets[self._next :]:
            if bucket.ready:
                bucket.launch(self.group)
        self._next = 0
        return [b for b in self.buckets if b.got]

    def done(self) -> None:
        for bucket in self.buckets:
            bucket.got = set()

    def discard(self) -> None:
        """Drop this iteration's gradients (``zero_grad``): wait for launched exchanges, forget them."""
        for bucket in self.buckets:
            for work, _, _ in bucket.rounds:
                work.wait()
            bucket.rounds, bucket.send, bucket.ready, bucket.got = [], None, set(), set()
        self._next = 0

    def gather_order(self, buckets: list[GradBucket]) -> list[GradBucket]:
        """``buckets`` in the order their all-gathers go out: that in which the forward hooks asked
        for them last time (``wait_params``), else the first layers' (the last buckets) first.
        Reading it starts the next round of requests."""
        # The collectives go out in one order on every rank: the hooks fire in the forward's module
        # order, the same on every rank. A model's own hook fires before its layers' and may ask
        # for its last layer's bucket (an output head) at once: parameter order would send that last.
        asked = {i: n for n, i in enumerate(self._asked)}
        self._asked = {}
        return sorted(reversed(buckets), key=lambda b: asked.get(id(b), len(asked)))

    def launch_gather(self, b: GradBucket) -> None:
        """All-gather every rank's rows of ``b``'s parameters, asynchronously (packing is one
        foreach copy); ``wait_params`` unpacks them. None of ``b`` may be pending already."""
        send = torch.empty(b.piece_numel, dtype=b.params[0].dtype, device=b.params[0].device)
        mine = [s.local_rows(p.detach()).reshape(-1) for p, s in zip(b.params, b.shards, strict=True)]
        torch._foreach_copy_([s.piece(send) for s in b.shards], mine)
        out = torch.empty(b.world * b.piece_numel, dtype=send.dtype, device=send.device)
        self.pending[id(b)] = (b, all_gather(out, send, self.group), out, send)

    def wait_params(self, buckets: list[GradBucket] | None = None) -> None:
        """Finish the pending all-gathers of ``buckets`` (default: all), in launch order: wait, then
        unpack the rows into the parameters (on the current stream: nothing after reads them early)."""
        wanted = None if buckets is None else {id(b) for b in buckets}
        if buckets is not None:  # a forward hook: the order of first requests orders the next round
            self._asked.update((id(b), None) for b in buckets)
        for i in [i for i in self.pending if wanted is None or i in wanted]:
            b, work, out, _ = self.pending.pop(i)
            work.wait()
            segments = out.view(b.world, b.piece_numel)
            pairs = [pair for p, s in zip(b.params, b.shards, strict=True)
                     for pair in s.gather_pairs(segments, p.detach())]  # fmt: skip
            torch._foreach_copy_([d for d, _ in pairs], [src for _, src in pairs])

    def buckets_of(self, params: list[Tensor]) -> list[GradBucket]:
        """The buckets that hold any of ``params`` (those these buckets know), the last bucket first:
        the first layers' first, the order ``gather_order`` gives what no hook asked for."""
        found = {id(p) for p in params}
        return [b for b in reversed(self.buckets) if any(id(p) in found for p in b.params)]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def refuse_ddp(params: list[Tensor], optimizer: str) -> None:
    """RuntimeError if a live ``DistributedDataParallel`` module holds any of ``params``: DDP
    all-reduces the gradients that the optimizer reduce-scatters, so they would be reduced twice.
    (DDP leaves no mark on a parameter; its modules are found among the live objects, once.)"""
    from torch.nn.parallel import DistributedDataParallel

    ours = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and any(id(p) in ours for p in obj.module.parameters()):
            raise RuntimeError(f"{optimizer} reduces gradients itself: under DistributedDataParallel they "
                               "would be reduced twice; give it the parameters of the model without DDP")  # fmt: skip
