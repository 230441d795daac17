"""Launch plans of the Triton Adam-mini kernel (kernel_templates/adam_mini.py.j2).

A plan covers the parameters of one group that share a device, a dtype and a momentum dtype:
it builds the work list once (one item per ROWS rows of per-row blocks and plain-Adam
tensors, one per head or whole-tensor block), the pointer tables, and per-step telemetry
buffers, and launches one kernel per step with no host synchronisation. CUDA tensors take the
multi-tensor variant; CPU tensors under TRITON_INTERPRET=1 the single-tensor one, per tensor.
FSDP2's DTensor params step through a subclass (``sharded_plan.py``) on their local rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import ADAM_MINI, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES, aligned, log2_pair, pointer_table, share_step_counts
from ..shared.dtensor import local
from ..shared.grad_table import GradTable
from .fp8 import fp8_layout
from .partition import ParamPartition

MOMENTUM_TRITON = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8e4nv"}
ROW, BLOCK, ADAM, GIVEN, SUM = 0, 1, 2, 3, 4  # item kinds, as the template numbers them
# A tensor whose rows are a multiple of VECTOR elements and whose storage is 16-byte aligned goes
# to a launch that promises both to the compiler (the template's VEC), so that its tiles move as
# 16-byte vectors; any other tensor goes to a second launch without the promise.
VECTOR = 16
# Per-row and block items of tensors whose rows split into at most three power-of-two tiles
# (multiples of the sub-block) go to launches of their own, one per row shape, that load whole rows
# at once (the template's _exact_item), with as many rows per program as keep at most
# EXACT_PER_THREAD elements of each stream in a thread. Block items (a head: many rows, two passes)
# come first in their launch, so that they do not finish last.
EXACT_PER_THREAD = 32
# Tensors per program of the begin kernel, the same for every group (more tensors take more
# programs): one variant to compile per process, where a BLOCK sized to each group made one per size.
BEGIN_BLOCK = 128


def exact_row_shape(part: ParamPartition, sub_block: int, rows: int, num_warps: int) -> tuple[int, tuple] | None:
    """(rows per program, (W0, W1, W2)) of the whole-row launch for ``part``, or None when its rows
    do not split into <= 3 power-of-two multiples of ``sub_block``, one row is too long for the
    registers, or ``part`` is plain Adam. 768 columns, sub-blocks of 128: (512, 256, 0)."""
    cols = part.cols
    if part.kind == "adam" or cols % sub_block or not cols:
        return None
    widths = [sub_block << b for b in reversed(range((cols // sub_block).bit_length())) if (cols // sub_block) >> b & 1]
    budget = EXACT_PER_THREAD * 32 * num_warps
    fit = rows
    while fit > 1 and fit * cols > budget:
        fit //= 2
    # Every tile must give each thread a whole 16-byte vector (4 elements): the template's inline
    # PTX takes a thread's elements four at a time.
    if len(widths) > 3 or fit * cols > budget or fit * widths[-1] < 4 * 32 * num_warps:
        return None
    return fit, tuple(widths + [0] * (3 - len(widths)))


def work_items(part: ParamPartition, tensor: int, rows_per_item: int) -> list[tuple[int, int, int, int, int]]:
    """(tensor, first row, rows, first second-moment index, kind) for every item of ``part``."""
    if part.kind == "adam":
        return [(tensor, r, min(rows_per_item, part.rows - r), 0, ADAM) for r in range(0, part.rows, rows_per_item)]
    items, vidx = [], 0
    for s in part.segments:
        if s.rows_per_block == 1:
            for r in range(s.start, s.start + s.count, rows_per_item):
                items.append((tensor, r, min(rows_per_item, s.start + s.count - r), vidx + r - s.start, ROW))
        else:
            items += [(tensor, s.start + b * s.rows_per_block, s.rows_per_block, vidx + b, BLOCK)
                      for b in range(s.blocks)]  # fmt: skip
        vidx += s.blocks
    return items


class AdamMiniTritonPlan:
    """Params of one group with one (device, dtype, momentum dtype); see the module docstring.
    ``parts`` give each param's matrix view (``kind``, ``rows``, ``cols``) and, through
    ``_items``, its work items."""

    def __init__(self, params: list[Tensor], states: list[dict], parts: list[ParamPartition],
                 sub_block: int, capacity: float) -> None:  # fmt: skip
        self.params, self.states, self.parts = params, states, parts
        self.locals = [local(p) for p in params]  # what the kernels update: a DTensor's local rows
        self.device = params[0].device
        self.multi_tensor = self.device.type == "cuda"
        momentum = states[0]["exp_avg"].dtype
        self.fp8 = momentum == torch.float8_e4m3fn
        self.variant = ADAM_MINI.variant(multi_tensor=self.multi_tensor, param_dtype=TRITON_DTYPES[params[0].dtype],
                                         momentum=MOMENTUM_TRITON[momentum])  # fmt: skip
        module = load(ADAM_MINI, self.variant)
        self.kernel, self.begin_kernel = module.adam_mini_kernel, module.adam_mini_begin_kernel
        self.sub_block = sub_block
        layouts = [fp8_layout(q.rows, q.cols, sub_block, capacity) for q in parts]
        # pool slots as allocated (a loaded pool keeps its saved size; a sharded param has none)
        caps = [s["exp_avg_pool"].shape[1] if "exp_avg_pool" in s else cap
                for s, (_, cap) in zip(states, layouts, strict=True)]  # fmt: skip
        self.meta_rows = [(q.cols, nsub, cap) for q, (nsub, _), cap in zip(parts, layouts, caps, strict=True)]
        self.sub_blocks = sum(q.rows * nsub for q, (nsub, _) in zip(parts, layouts, strict=True)) if self.fp8 else 0
        self._dummy = torch.zeros(1, dtype=torch.int32, device=self.device)  # unused FP8 tables' target
        # One buffer of step counts, state['step'] views of it, advanced on the device by the
        # template's begin kernel, which also writes each tensor's bias-correction factors into
        # coefs (T, 4) (no host sync).
        self.steps = share_step_counts(states, self.device)
        self.coefs = torch.zeros((len(params), 4), dtype=torch.float32, device=self.device)
        # Likewise one (T, 2) buffer of pool counters (FP8): the begin kernel clears the half this
        # step counts its requests in; the other half, last step's, lets the update skip the pool
        # gather in tensors that made no request.
        self.used = self._dummy
        if self.fp8:
            self.used = torch.stack([s["exp_avg_pool_used"].to(self.device, torch.int32) for s in states])
            for i, s in enumerate(states):
                s["exp_avg_pool_used"] = self.used[i]
        # Telemetry, read only when asked: int64 (bf16 sub-blocks, overflows) of the last step, then
        # their running totals; the last step's max |update| is the max over the amax slots.
        self.tel_count = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.tel_amax = torch.zeros(module.AMAX_SLOTS.value * 32, dtype=torch.float32, device=self.device)
        arch = "cpu" if self.device.type == "cpu" else detect_arch(self.device)
        total = sum(t.numel() for t in self.locals)
        self.configure(select(ADAM_MINI, arch, self.variant, self.variant["param_dtype"], total))
        self._warm: list[precompile.Warm] = []  # kernels compiling in the background (precompile.py)
        if self.multi_tensor:
            self._grads = GradTable(self.device, len(params))
            self._tables = [self._table(key) for key in ("p", "m", "scale", "pool", "used", "v")]
            if precompile.enabled(self.device):  # placeholders: a dtype for no tensor, zeros for the floats
                begin = (self.begin_kernel, (1,), self._begin_args(0.0, (0.0, 0.0)), dict(BLOCK=BEGIN_BLOCK))
                self._warm = precompile.warm_launches([begin, *self._placeholder_updates()], self.device)

    def _placeholder_updates(self) -> list[tuple]:
        """The update launches of the current config with zeros for the step's floats (what a
        background compile needs: precompile.py)."""
        return self._multi_launches(self._launches, self._grads.table, None, (0.0,) * 6)

    def warm_config(self, config) -> list[precompile.Warm]:
        """Compile the update launches of ``config`` in the background and stay on the current
        config (the tuner's compile-ahead); nothing to do off CUDA."""
        return precompile.warm_config(self, config, self._placeholder_updates) if self.multi_tensor else []

    def _tensor(self, i: int, key: str) -> Tensor:
        state = self.states[i]
        name = {"p": None, "m": "exp_avg", "scale": "exp_avg_scale", "pool": "exp_avg_pool",
                "used": "exp_avg_pool_used", "v": "exp_avg_sq"}[key]  # fmt: skip
        if name is None:
            return self.locals[i]
        return state.get(name, self._dummy) if key in ("scale", "pool", "used") else state[name]

    def _table(self, key: str) -> Tensor:
        return pointer_table([self._tensor(i, key) for i in range(len(self.params))], self.device)

    def configure(self, config) -> None:
        """Launch with ``config`` from now on (the tuner and benchmarks try configs this way)."""
        self.config = dict(ADAM_MINI.check_config(config))
        rows, warps = self.config["ROWS"], self.config["num_warps"]
        # Launch key -> items: (tensor for single-tensor launches else -1, VEC, rows per program, widths).
        groups: dict[tuple, list] = {}
        for i, q in enumerate(self.parts):
            tensor = -1 if self.multi_tensor else i
            vec = VECTOR if self.multi_tensor and self._vectorizable(i) else 1
            exact = exact_row_shape(q, self.sub_block, rows, warps)
            key = (tensor, vec, *exact) if exact is not None else (tensor, vec, rows, (0, 0, 0))
            groups.setdefault(key, []).extend(self._items(q, i, key[2]))
        self.meta = torch.tensor(self.meta_rows, dtype=torch.int32, device=self.device)
        self._launches = self._launch_list(groups)

    def _launch_list(self, groups: dict[tuple, list]) -> list[tuple[tuple, Tensor]]:
        """(key, its items as an int32 [n, 5] device tensor, block items first) per non-empty key."""
        return [
            (key, torch.tensor(sorted(its, key=lambda it: it[4] not in (BLOCK, GIVEN)), dtype=torch.int32,
                               device=self.device).view(-1, 5))
            for key, its in sorted(groups.items()) if its
        ]  # fmt: skip

    def _items(self, part, tensor: int, rows_per_item: int) -> list[tuple[int, int, int, int, int]]:
        """The update launch's work items of param ``tensor``."""
        return work_items(part, tensor, rows_per_item)

    def _vectorizable(self, i: int) -> bool:
        # Grads are made 16-byte aligned by GradTable; the state is allocated here, but a loaded
        # state or a parameter view may start anywhere.
        return aligned([self._tensor(i, k) for k in ("p", "m", "pool", "v")]) and self.parts[i].cols % VECTOR == 0

    def run(self, group: dict, checked_grads) -> None:
        """One step (the begin kernel, then the update launches); ``checked_grads()`` returns the
        grads validated. Its telemetry stays on the device: ``tel_count``, ``step_amax``."""
        self.begin(group)
        self.launch(self._launches, group, checked_grads)

    def begin(self, group: dict) -> None:
        """The begin kernel: step counts, bias corrections, per-step counters (template header)."""
        precompile.wait_all(self._warm)
        args = self._begin_args(float(group["lr"]), tuple(float(b) for b in group["betas"]))
        self.begin_kernel[(-(-len(self.params) // BEGIN_BLOCK),)](*args, BLOCK=BEGIN_BLOCK)

    def _begin_args(self, lr: float, betas: tuple[float, float]) -> tuple:
        return (self.steps, self.coefs, self.used, self.tel_count, self.tel_amax, len(self.params), lr,
                *log2_pair(betas[0]), *log2_pair(betas[1]))  # fmt: skip

    def launch(self, launches: list, group: dict, checked_grads, v_table: Tensor | None = None,
               v_of=None, grad_table: Tensor | None = None) -> None:  # fmt: skip
        """The kernel over ``launches`` ((key, items) as ``configure`` builds them); ``v_table`` /
        ``v_of(i)`` replace the second moments the items read and write (``sharded_plan.py``'s sums);
        ``grad_table``: the gradients' table as this step already checked it (multi-tensor)."""
        if not launches:
            return
        b1, b2 = (float(b) for b in group["betas"])
        lr = float(group["lr"])
        scalars = (lr, b2, 1.0 - b1, 1.0 - b2, float(group["eps"]), 1.0 - lr * float(group["weight_decay"]))
        precompile.wait_all(self._warm)
        if self.multi_tensor:
            g_t = grad_table if grad_table is not None else self._grads.update(self.params, checked_grads)
            for kernel, grid, args, kwargs in self._multi_launches(launches, g_t, v_table, scalars):
                kernel[grid](*args, **kwargs)
        else:
            launch = self._launch_options()
            grads = checked_grads()
            for (i, _, rows, (w0, w1, w2)), items in launches:
                cols, nsub, cap = self.meta_rows[i]
                m, scale, pool, used, v = (self._tensor(i, k) for k in ("m", "scale", "pool", "used", "v"))
                self.kernel[(items.shape[0],)](
                    items, self.locals[i], grads[i].contiguous(), m, scale, pool, used, v if v_of is None else v_of(i),
                    self.coefs[i], self.tel_count, self.tel_amax, cols, nsub, cap, *scalars, **launch, ROWS=rows,
                    VEC=1, W0=w0, W1=w1, W2=w2,
                )  # fmt: skip

    def _launch_options(self) -> dict:
        return dict(COLS=self.config["COLS"], SUB=self.sub_block, num_warps=self.config["num_warps"],
                    num_stages=self.config["num_stages"])  # fmt: skip

    def _multi_launches(self, launches: list, g_t: Tensor, v_table: Tensor | None, scalars: tuple) -> list[tuple]:
        """(kernel, grid, args, kwargs) of the multi-tensor update launches over ``launches``."""
        p_t, m_t, s_t, pool_t, used_t, v_t = self._tables
        options = self._launch_options()
        return [(self.kernel, (items.shape[0],),
                 (items, self.meta, p_t, g_t, m_t, s_t, pool_t, used_t, v_t if v_table is None else v_table,
                  self.coefs, self.tel_count, self.tel_amax, *scalars),
                 dict(**options, ROWS=rows, VEC=vec, W0=w0, W1=w1, W2=w2))
                for (_, vec, rows, (w0, w1, w2)), items in launches]  # fmt: skip

    def step_amax(self) -> Tensor:
        """The last step's largest |Adam update| (0-d fp32; one reduction, run when called)."""
        return self.tel_amax.max()
