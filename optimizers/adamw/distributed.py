"""``DistributedAdamW``: ZeRO-2 AdamW for a model that is not wrapped (no FSDP2, no DDP).

Every rank holds the whole model; each owns FSDP2's dim-0 shard of every parameter (``torch.chunk``
rows, tail ranks possibly empty) and keeps AdamW's state for that shard only. Gradients are
reduce-scattered in buckets while backward runs (``shared/zero_buckets``), fused AdamW launches
update the local shards in place (three per group: ``_pipeline``), and an all-gather per bucket
brings the other ranks' rows back. The states are ``Shard(0)`` DTensors of the parameters' global
shapes, so DCP saves them as FSDP2 + ``torch.optim.AdamW`` would, and either loads the other's
checkpoint at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..shared.checks import check_params_once, evaluate_closure
from ..shared.clip_grad import clip_grad_norm_
from ..shared.eager import eager_step
from ..shared.row_shards import RowShard
from ..shared.zero_buckets import ZeroGrads, refuse_ddp
from .optimizer import AdamW
from .plan import group_plan, init_group_state

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class DistributedAdamW(AdamW):
    """AdamW with ZeRO-2 sharding over ``process_group`` (default: the world), for plain models.

    Args: as :class:`AdamW`, plus ``process_group``, ``bucket_cap_mb`` (the most gradient bytes
    reduce-scattered together; 400, not DDP's 25: each bucket costs a reduce-scatter and an
    all-gather launched from Python, and each lines the ranks up; at 25 MB a 1B-parameter model's
    ~80 collectives an iteration made it a third slower, see docs/distributed.md) and
    ``gather_in_forward``: modules in the order the forward runs them, each holding the
    parameters it uses, e.g. ``[model.embed_tokens, *model.layers, model.norm, model.lm_head]``.
    Given, ``step()`` leaves the updated parameters' all-gathers in flight, and each listed
    module's next forward first waits for those of the parameters it holds (less those of a module
    listed before it), so the gathers overlap the forward's compute. (FSDP2's units, the layers
    and then the model, work too, but the model's hook fires first and waits for the output
    head's gathers with the embedding's: more of the gathers exposed, see docs/distributed.md.)
    The step itself runs in three launches: the bucket the next forward needs first is stepped
    between the two halves of the others, so its reduce-scatter (backward's last) finishes
    under the first half and its all-gather goes out under the second. A parameter is current
    once the forward of the module that holds it has begun, after ``wait_params()``, or in a
    listed module's ``state_dict()`` (as FSDP2's, a parameter read outside its module's forward
    before then is last step's).
    The gathers go out in the order the hooks asked for them in the last forward, so every rank
    must run the listed modules' forwards in the same order (as it must produce the same grads).

    Build it after the model is on its device and identical on every rank; parameters must have
    ndim >= 1 and not be DTensors (a sharded model takes :class:`AdamW` itself). Needs
    ``torch.distributed`` initialized (e.g. by ``torchrun``).

    Use: ``loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()``; wrap the backward passes that only
    accumulate in ``with opt.no_sync():``. Every rank must produce gradients for the same
    parameters in an iteration (as DDP without ``find_unused_parameters``). After ``backward`` the
    parameters' ``.grad`` are None: the gradients live reduced and sharded in the optimizer. Not
    supported: ``GradScaler`` (fp16 loss scaling), CUDA graph capture, ``DistributedDataParallel``
    around the same model (refused: the gradients would be reduced twice).

    ``state_dict()`` holds ``Shard(0)`` DTensor states; save and load through DCP
    (``torch.distributed.checkpoint.state_dict``) to change the world size. ``telemetry``'s
    ``amax_update`` is this rank's shard's.
    """

    _step_supports_amp_scaling = True  # so that GradScaler hands us grad_scale, and we refuse it
    # False: one launch per group once every reduce-scatter is in, then every all-gather (the
    # baseline of the pipelined step: ``benchmarks/bench_dist.py --zero2-step single``)
    pipelined_step = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        *args,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 400.0,
        gather_in_forward: Iterable[torch.nn.Module] | None = None,
        **kwargs,
    ) -> None:
        """``args`` and ``kwargs``: :class:`AdamW`'s (lr, betas, eps, weight_decay, amsgrad, ...)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedAdamW needs torch.distributed initialized (e.g. launch with torchrun "
                               "and call init_process_group); in one process use AdamW")  # fmt: skip
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.process_group = process_group or dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        self._meshes: dict[str, DeviceMesh] = {}
        self._shards: dict[int, tuple[RowShard, DTensor]] = {}  # id(param) -> its layout and shard param
        super().__init__(params, *args, **kwargs)
        trained = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        refuse_ddp(trained, "DistributedAdamW")
        element = max((p.element_size() for p in trained), default=4)
        self._grads = ZeroGrads(trained, {id(p): self._shards[id(p)][0] for p in trained}, self.process_group,
                                int(bucket_cap_mb * 2**20) // element)  # fmt: skip
        self._ddp_checked = False
        self._module_hooks = self._hook_units(list(gather_in_forward or []))

    def _hook_units(self, modules: list[torch.nn.Module]) -> list:
        """Forward pre-hooks that finish the all-gathers of each module's parameters (those no module
        before it in ``modules`` holds), and state_dict pre-hooks that finish them all."""
        claimed: set[int] = set()
        hooks = []
        for i, module in enumerate(modules):
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"gather_in_forward[{i}] must be a torch.nn.Module, got {type(module).__name__}")
            mine = [p for p in module.parameters() if id(p) not in claimed]
            claimed.update(map(id, mine))
            buckets = self._grads.buckets_of(mine)
            hooks.append(module.register_forward_pre_hook(lambda *_, b=buckets: self._grads.wait_params(b)))
            hooks.append(module.register_state_dict_pre_hook(lambda *_: self._grads.wait_params()))
        return hooks

    def wait_params(self) -> None:
        """Finish the parameters' all-gathers that ``step()`` left in flight (``gather_in_forward``)."""
        self._grads.wait_params()

    def _prebuild_plans(self) -> None:
        """None at construction: the plans step this rank's shard params, which the first step makes
        (AdamW's plans for the whole params would be the wrong ones)."""

    def _mesh(self, device_type: str) -> DeviceMesh:
        mesh = self._meshes.get(device_type)
        if mesh is None:
            mesh = self._meshes[device_type] = DeviceMesh.from_group(self.process_group, device_type)
        return mesh

    def _as_shard(self, p: Tensor, local: Tensor) -> DTensor:
        """``local`` (this rank's rows of something shaped like ``p``) as a Shard(0) DTensor of p's shape."""
        return DTensor.from_local(local, self._mesh(p.device.type), [Shard(0)], run_check=False,
                                  shape=p.shape, stride=p.stride())  # fmt: skip

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then each new parameter's shard (a Shard(0) DTensor over its rows) and state."""
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            where = f"DistributedAdamW: parameter {i} of param group {len(self.param_groups) - 1}"
            if isinstance(p, DTensor):
                raise TypeError(f"{where} is a DTensor (FSDP2 or tensor parallel): sharded models take AdamW")
            if p.dim() == 0:
                raise ValueError(f"{where} is 0-d: FSDP2's dim-0 layout needs ndim >= 1 (reshape it to (1,))")
            if not p.is_contiguous():
                raise ValueError(f"{where} is not contiguous: its rows must be a view to update in place")
            shard = RowShard(tuple(p.shape), self.world, self.rank)
            # requires_grad like FSDP2's sharded params, whose conventions the AdamW plan follows
            shard_param = self._as_shard(p, shard.local_rows(p.detach())).requires_grad_(p.requires_grad)
            self._shards[id(p)] = (shard, shard_param)
        init_group_state({**group, "params": self._shard_params(group["params"])}, self._shard_states())

    def _shard_params(self, params: list[Tensor]) -> list[DTensor]:
        return [self._shards[id(p)][1] for p in params if p.requires_grad]

    def _shard_states(self) -> dict[DTensor, dict]:
        """Each shard param's state: the dict ``self.state`` holds for its full parameter."""
        return {self._shards[id(p)][1]: self.state[p] for g in self.param_groups for p in g["params"]
                if p.requires_grad}  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's loader; then any full-shape (not DTensor) state, as ``torch.optim.AdamW.state_dict()``
        of one process holds, is cut to this rank's rows. DTensor states (DCP) load as they are."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                for key in _STATE_KEYS:
                    t = state.get(key)
                    if t is not None and not isinstance(t, DTensor):
                        shard = self._shards[id(p)][0]
                        state[key] = self._as_shard(p, shard.local_rows(t).clone())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside leave their gradients in ``.grad`` (accumulating); the next one
        outside reduces the sum."""
        self._grads.syncing = False
        try:
            yield
        finally:
            self._grads.syncing = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's (the ``.grad`` that ``no_sync`` accumulated), and the reduced gradients not stepped."""
        super().zero_grad(set_to_none)
        self._grads.discard()

    def _reduced(self, bucket) -> None:
        """Wait for ``bucket``'s reduce-scatters; each of its shard params' ``.grad`` is then a
        Shard(0) DTensor over its rows of the bucket's reduced buffer."""
        bucket.wait()
        for p, shard in zip(bucket.params, bucket.shards, strict=True):
            shard_param = self._shards[id(p)][1]
            if shard_param.grad is None:  # the reduced buffer stays put: grad tables are built once
                shard_param.grad = self._as_shard(p, shard.piece(bucket.reduced).view_as(shard_param.to_local()))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for this optimizer's gradients, which after backward
        live reduced and sharded here (the parameters' ``.grad`` are None): call between backward
        and ``step()``. Returns the total norm (0-d fp32, the same on every rank)."""
        buckets = self._grads.launch_rest()
        for b in buckets:
            self._reduced(b)
        shard_params = [self._shards[id(p)][1] for b in buckets for p in b.params if id(p) in b.got]
        return clip_grad_norm_(shard_params, max_norm, norm_type, error_if_nonfinite)

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Reduce-scatter what backward left, step the local shards, all-gather the parameters."""
        loss = evaluate_closure(closure)
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise RuntimeError("DistributedAdamW does not take GradScaler (fp16 loss scaling); train in bf16")
        if not self._grads.syncing:
            raise RuntimeError("DistributedAdamW.step() inside no_sync(): leave no_sync for the last backward")
        check_params_once(self)
        if not self._ddp_checked:  # DDP may wrap the model after the optimizer was built
            refuse_ddp([p for g in self.param_groups for p in g["params"]], "DistributedAdamW")
            self._ddp_checked = True
        self._grads.wait_params()  # the last step's gathers, where no forward came between
        buckets = self._grads.launch_rest()
        order = self._grads.gather_order(buckets)
        states = self._shard_states()
        # pipelined: the bucket the next forward needs first stepped between the halves of the rest
        stages = _pipeline(buckets, order[0]) if buckets and self.pipelined_step else ([], [], buckets)
        with self.telemetry.step(self.param_groups[0]["params"][0].device) as telemetry:
            for part, stage in enumerate(stages):
                for b in stage:
                    self._reduced(b)
                got = {i for b in stage for i in b.got}
                for index, group in enumerate(self.param_groups):
                    params = [self._shards[id(p)][1] for p in group["params"] if id(p) in got]
                    if params:
                        plan = group_plan(self._plans, (index, part), params, states, group, self.backend)
                        plan.run(group, None, None)
                        telemetry.watch("amax_update", plan.update_amax)
                if part == 1:  # the bucket the next forward needs first: out while the rest steps
                    for b in stage:
                        self._grads.launch_gather(b)
        for b in order[len(stages[1]) :]:
            self._grads.launch_gather(b)
        if not self._module_hooks:
            self._grads.wait_params()
        self._grads.done()
        return loss


def _pipeline(buckets: list, first) -> tuple[list, list, list]:
    """The three stages of a step over ``buckets`` (launch order), so that the two collectives
    nothing else can hide do not wait in line: ``first`` (the bucket whose all-gather the next
    forward needs first; in a plain model the first layers' and embeddings', the last bucket
    backward reduce-scatters) is stepped between the two halves (by elements) of the others. Its
    reduce-scatter, launched as backward ends, finishes while the first half steps; its all-gather
    goes out while the second half steps. Every bucket before ``first`` in launch order had its
    reduce-scatter issued before it, so the first half rarely waits."""
    rest = [b for b in buckets if b is not first]
    half, before = sum(b.piece_numel for b in rest) / 2, 0
    cut = 0
    while cut < len(rest) and before + rest[cut].piece_numel / 2 <= half:
        before += rest[cut].piece_numel
        cut += 1
    return rest[:cut], [first], rest[cut:]
