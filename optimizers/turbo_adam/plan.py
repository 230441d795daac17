"""Launch plans for TurboAdam's fused step (kernel_templates/turbo_adam.py.j2).

A ``TurboLaunch`` steps the compressed parameters of one layout on one device, and on CUDA the
group's exact ones (tensors under the size thresholds) in the same launch: a stats launch when
the layout's v is factored (Adafactor's row and column statistics of this step's g²), then the
update launch. On CUDA one launch covers all its tensors through pointer tables; under the
interpreter (CPU tests) there is one launch per tensor, whose programs cannot load addresses.

FSDP2's sharded matrices (rows split on one mesh dim) take their own launches (``split_rows``):
``run_stats`` leaves this rank's column sums of g² in buffers the optimizer adds over the shard
group (``shared.shard_sums``), then ``run`` finishes the column statistics (a columns launch)
and steps the local rows as one process would, the random bits those of the global elements.

Nothing in ``run`` reads the device: step counts, lr, GradScaler's scale and inf, telemetry all
stay there, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import TURBO_ADAM, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import (
    TRITON_DTYPES,
    LrBuffer,
    issue,
    kernel_path,
    log2_pair,
    pointer_table,
    share_step_counts,
)
from ..shared.checks import checked_grads
from ..shared.dtensor import DTensor, local
from ..shared.grad_table import GradTable
from ..shared.log_codes import PLANE_GROUP
from . import codecs
from .distributed import row_span
from .reference import Layout, matrix_view

AMAX_SLOTS, META = 64, 10  # the template's: telemetry slots, int64 fields per tensor of the meta table
STATS_BAND_TILE = 8  # bands the last band of a stripe adds per load (the template's NBT)
# the stats launch's tile (the template's RT x TC): a program is a band of rows x a stripe of TC
# columns, summed elementwise over the band; 64 bytes of a row a thread (16 fp32 or 32 bf16 rows:
# the fastest of eight tiles timed on the H200, 134M list)
STATS_COLS, STATS_WARPS, STATS_ROW_BYTES = 256, 4, 64
# bands of a tensor at most: the last band of a stripe adds the bands' column sums alone, so a tall
# matrix (an embedding) takes bands of more than BAND rows rather than keep one program busy
MAX_BANDS = 64
V_AXIS = {None: "exact", codecs.FACTORED: "factored", codecs.LOG4: "log4", codecs.LOG8: "log8"}


def kernel_block(block: int) -> bool:
    """Whether the kernels take ``block`` (elements per scale): 32, 64 or 128 (blocks inside a
    128-column group), or 256 / 512 (whole groups of one tile)."""
    return block in (32, 64, 128, 256, 512)


class LaunchTelemetry:
    """A launch's device counters: the launch count (int32, with the programs' arrival counter),
    max |update| slots (two halves of AMAX_SLOTS, by launch parity) and clipped factored codes
    (int64, two halves); the last program of a launch clears the half the next one writes."""

    def __init__(self, device: torch.device) -> None:
        self.launch = torch.zeros(2, dtype=torch.int32, device=device)
        self.amax_slots = torch.zeros(2 * AMAX_SLOTS, dtype=torch.float32, device=device)
        self.clip = torch.zeros(2, dtype=torch.int64, device=device)

    def _last_half(self) -> Tensor:
        return ((self.launch[:1] + 1) % 2).long()  # the half the last launch wrote: (count - 1) % 2

    def amax(self) -> Tensor:
        """The last launch's largest |update| (0-d fp32), computed when called: no sync."""
        return self.amax_slots.view(2, AMAX_SLOTS).index_select(0, self._last_half()).max()

    def clipped(self) -> Tensor:
        """Elements of the last launch whose fresh v fell outside the factored codes' range (0-d)."""
        return self.clip.index_select(0, self._last_half()).sum()


class TurboLaunch:
    """The fused step of ``params`` (compressed in ``layout``, one device and dtype; plain tensors, or
    all DTensors whose rows alone are split: their local rows) and, on CUDA, of ``exact`` (plain
    tensors: fp32 moments, AdamW's arithmetic). ``seeds``: each param's random stream."""

    def __init__(self, params: list[Tensor], states: list[dict], layout: Layout, seeds: list[int],
                 exact: tuple[Tensor, ...] = (), exact_states: tuple[dict, ...] = (),
                 multi_tensor: bool = True) -> None:  # fmt: skip
        self.sources = list(params) + list(exact)
        self.params = [local(p).detach() for p in self.sources]
        self.layout = layout
        self.multi_tensor = multi_tensor
        self.n_coded = len(params)
        # rows split across ranks (FSDP2): where v is factored, the column sums are added over the
        # shard group between two launches
        self.split = isinstance(params[0], DTensor)
        if any(isinstance(p, DTensor) != self.split for p in self.sources):
            raise ValueError("TurboLaunch: sharded and plain tensors take separate launches")
        factored = layout.v_codec == codecs.FACTORED
        self._column_views: dict[int, Tensor] = {}  # tensor -> its slot of a ShardSums buffer
        dev = self.device = self.params[0].device
        self.states = list(states) + list(exact_states)
        self.steps = share_step_counts(self.states, dev)
        self.lr = LrBuffer(dev)
        # one set of counters per launch: the interpreter launches once per tensor
        self.telemetries = [LaunchTelemetry(dev) for _ in range(1 if multi_tensor else len(self.params))]
        self._dummy = torch.zeros(16, dtype=torch.float32, device=dev)
        self._one, self._zero = torch.ones((), device=dev), torch.zeros((), device=dev)
        self.variant = dict(multi_tensor=multi_tensor, param_dtype=TRITON_DTYPES[self.params[0].dtype],
                            m_codec="q4" if layout.compress_m else "exact", v_codec=V_AXIS[layout.v_codec],
                            exact_items=bool(exact), split_rows=self.split and factored)  # fmt: skip
        arch = "cpu" if dev.type == "cpu" else detect_arch(dev)
        total = sum(p.numel() for p in self.params)
        self.config = dict(select(TURBO_ADAM, arch, TURBO_ADAM.variant(**{**self.variant, "grad_scaling": False}),
                                  self.variant["param_dtype"], total))  # fmt: skip
        self._kernels: dict[bool, object] = {}
        self._warm: dict[bool, list[precompile.Warm]] = {}  # kernels compiling in the background
        self._step_launches: list[tuple] | None = None  # formed by run_stats for this step's run
        self._build(seeds)
        if multi_tensor and precompile.enabled(dev):
            self._precompile()

    # -- tables --------------------------------------------------------------------------------
    def _build(self, seeds: list[int]) -> None:
        dev, cfg, layout = self.device, self.config, self.layout
        rows_g = max(cfg["G"], layout.block // PLANE_GROUP)  # a tile holds whole blocks
        self.config["G"] = rows_g
        shapes = [matrix_view(p).shape for p in self.params]
        spans = [row_span(p) for p in self.sources]  # (global row of local row 0, global rows)
        # vector accesses need every row to start 16 elements apart; offsets fit int32 below 2^31
        self.aligned = all(cols % 16 == 0 for _, cols in shapes)
        self.stats_rows = STATS_ROW_BYTES // self.params[0].element_size()
        self.full = all(cols % (rows_g * PLANE_GROUP) == 0 for _, cols in shapes)  # no tile past a row's end
        self.int64 = any(rows * -(-cols // PLANE_GROUP) * PLANE_GROUP >= 2**31 for rows, cols in shapes)
        factored = layout.v_codec == codecs.FACTORED
        n = len(self.params)
        self.done = torch.zeros(n, dtype=torch.int32, device=dev)
        self.stats_done = torch.zeros(n, dtype=torch.int32, device=dev)
        fresh = not hasattr(self, "mean")  # kept across configure(): the means codes were written against
        if fresh:
            self.mean = torch.zeros((n, 2), dtype=torch.float32, device=dev)
        meta = torch.zeros((n, META), dtype=torch.int64)
        items, bands = [], {}
        ws_off, next_rows, next_cols, stripes = 0, [], [], []
        band_slots = stripe_slots = 0  # the stats launch's counters: one per band, one per stripe
        span = cfg["SPAN"] * rows_g
        for t, (rows, cols) in enumerate(shapes):
            coded = t < self.n_coded
            ngroups = -(-cols // PLANE_GROUP)
            r0 = torch.arange(0, rows, cfg["ROWS"])
            g0 = torch.arange(0, ngroups, span)
            rr, gg = torch.meshgrid(r0, g0, indexing="ij")
            rr, gg = rr.reshape(-1), gg.reshape(-1)
            item = torch.stack([torch.full_like(rr, t), torch.full_like(rr, 0 if coded else 1), rr, gg,
                                (ngroups - gg).clamp(max=span)], 1)  # fmt: skip
            items.append(item)
            tile = self.stats_rows
            band_rows = -(-max(cfg["BAND"], -(-rows // MAX_BANDS)) // tile) * tile
            nbands = -(-rows // band_rows) if coded and factored else 0
            nstripes = -(-cols // STATS_COLS)
            seed = seeds[t] if coded else 0
            # workspace: column partials [bands, cols], row partials [stripes, rows], the stripes'
            # sums of col_next [stripes], then log2 col_next [cols] at field 9, 16 elements aligned
            # (the update launch loads it in vectors)
            log2_col_off = -(-(ws_off + nbands * cols + nstripes * (rows + 1)) // 16) * 16 if nbands else 0
            row_base, global_rows = spans[t]
            meta[t] = torch.tensor([rows, cols, row_base, seed, item.shape[0], nbands, ws_off, global_rows, band_rows,
                                    log2_col_off])  # fmt: skip
            if nbands:
                b, st = (x.reshape(-1) for x in torch.meshgrid(torch.arange(nbands), torch.arange(nstripes),
                                                              indexing="ij"))  # fmt: skip
                bands[t] = torch.stack([torch.full_like(b, t), b, st, band_slots + b, stripe_slots + st], 1)
                band_slots, stripe_slots = band_slots + nbands, stripe_slots + nstripes
                ws_off = log2_col_off + cols
                row, col = local(self.states[t]["exp_avg_sq_row"]), local(self.states[t]["exp_avg_sq_col"])
                next_rows.append(torch.empty_like(row))
                next_cols.append(self._column_views.get(t, torch.empty_like(col)))
                stripes.append(torch.stack([torch.full((nstripes,), t), torch.arange(nstripes)], 1))
                if fresh:
                    self.mean[t, 0] = col.mean()
        # big tensors first: their programs (and their last, stats-adding one) start early
        order = sorted(range(n), key=lambda t: -self.params[t].numel())
        work = torch.cat([items[t] for t in order]).to(torch.int32)
        stats = torch.cat([bands[t] for t in order if t in bands]).to(torch.int32) if bands else None
        self.work = work.contiguous().to(dev)
        self.stats_work = stats.contiguous().to(dev) if stats is not None else None
        # the columns launch's (tensor, stripe) items: rows split across ranks only
        self.columns_work = torch.cat(stripes).to(torch.int32).to(dev) if self.split and stripes else None
        # the interpreter's launches, one tensor each
        self._work_of = [work[work[:, 0] == t].contiguous() for t in range(n)] if not self.multi_tensor else []
        self._bands_of = {t: b.to(torch.int32).contiguous() for t, b in bands.items()} if not self.multi_tensor else {}
        self._stripes_of = {int(st[0, 0]): st.to(torch.int32).contiguous() for st in stripes} \
            if self.split and not self.multi_tensor else {}  # fmt: skip
        self.meta = meta.to(dev)
        self.workspace = torch.empty(max(ws_off, 1), dtype=torch.float32, device=dev)
        self.band_done = torch.zeros(max(band_slots, 1), dtype=torch.int32, device=dev)
        self.stripe_done = torch.zeros(max(stripe_slots, 1), dtype=torch.int32, device=dev)
        self.row_next, self.col_next = next_rows, next_cols
        self._grads = GradTable(dev, n) if self.multi_tensor and dev.type == "cuda" else None
        self._pointers = self._state_pointers()
        if self.multi_tensor:
            self._tables = [pointer_table(ts, dev) for ts in self._pointers]

    def _state_pointers(self) -> list[list[Tensor]]:
        """Per tensor, the tensors behind p, m, m scale, v, v base, row, col, row next, col next
        (the dummy where a tensor has none)."""
        d = self._dummy
        out = [[] for _ in range(9)]
        nxt = iter(zip(self.row_next, self.col_next, strict=True))
        for t, (p, state) in enumerate(zip(self.params, self.states, strict=True)):
            coded = t < self.n_coded
            s = {key: local(x) for key, x in state.items()}  # a sharded param's states: their local rows
            m = s.get("exp_avg_codes", s.get("exp_avg"))
            v = s.get("exp_avg_sq_codes", s.get("exp_avg_sq"))
            rn, cn = next(nxt) if coded and self.layout.v_codec == codecs.FACTORED else (d, d)
            for i, x in enumerate((p, m, s.get("exp_avg_scale", d), v, s.get("exp_avg_sq_base", d),
                                   s.get("exp_avg_sq_row", d), s.get("exp_avg_sq_col", d), rn, cn)):  # fmt: skip
                out[i].append(x)
        return out

    # -- launching -----------------------------------------------------------------------------
    def kernels(self, grad_scaling: bool):
        k = self._kernels.get(grad_scaling)
        if k is None:
            k = self._kernels[grad_scaling] = load(TURBO_ADAM, TURBO_ADAM.variant(**self.variant,
                                                                                grad_scaling=grad_scaling))  # fmt: skip
        return k

    def grads(self) -> list[Tensor]:
        return checked_grads(self.sources)

    def use_column_sums(self, views: dict[int, Tensor]) -> None:
        """Rows split across ranks: keep each factored tensor's column sums (then its col_next) in
        ``views`` (by ``id`` of the source param: its slot of a ``ShardSums`` buffer, which the
        optimizer adds over the shard group between ``run_stats`` and ``run``)."""
        mine = {t: views[id(p)] for t, p in enumerate(self.sources[: self.n_coded]) if id(p) in views}
        if mine.keys() != self._column_views.keys() or any(v is not self._column_views[t] for t, v in mine.items()):
            self._column_views = mine
            self._build([int(s) for s in self.meta[: self.n_coded, 3].tolist()])

    def run_stats(self, lr: float | Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
                  grad_scale: Tensor | None, found_inf: Tensor | None) -> None:  # fmt: skip
        """Rows split across ranks: the stats launch, which leaves this rank's column sums of g² (and
        the rows' new statistics) for ``run``; nothing otherwise. The step's launches are formed
        here once (each gradient's address checked once) and kept for ``run``."""
        if self.split and self.stats_work is not None:
            self._step_launches = self._formed(lr, betas, eps, weight_decay, grad_scale, found_inf)
            issue(self._step_launches, ("stats",))

    def run(self, lr: float | Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
            grad_scale: Tensor | None, found_inf: Tensor | None) -> None:  # fmt: skip
        """One step of the launch's tensors (where rows are split: after ``run_stats`` and the shard
        group's sum of the column sums)."""
        launches = self._step_launches or self._formed(lr, betas, eps, weight_decay, grad_scale, found_inf)
        self._step_launches = None
        issue(launches, ("columns", "update") if self.split else ("stats", "update"))

    def _formed(self, lr, betas, eps, weight_decay, grad_scale, found_inf) -> list[tuple]:
        """(phase, launch) of every phase of this step (``issue`` runs them)."""
        scaling = grad_scale is not None or found_inf is not None
        # without GradScaler the kernels read neither: constants made once, no per-step allocation
        gs = grad_scale.to(self.device) if grad_scale is not None else self._one
        fi = found_inf.to(self.device) if found_inf is not None else self._zero
        b1, b2 = (float(b) for b in betas)
        upd = (b2, 1.0 - b1, 1.0 - b2, *log2_pair(b1), *log2_pair(b2), float(eps), float(weight_decay))
        lr_t = self.lr(lr)
        if self.multi_tensor:
            precompile.wait_all(self._warm.pop(scaling, []))
            return self._launches(scaling, self._grads.update(self.sources, self.grads), lr_t, gs, fi, upd)
        return self._single_launches(scaling, lr_t, gs, fi, upd)

    def _launch_configs(self) -> tuple[dict, dict]:
        """The stats launch's and the update launch's compile-time options."""
        cfg = self.config
        flags = dict(ALIGNED=self.aligned, INT64=self.int64)
        stats_cfg = dict(RT=self.stats_rows, TC=STATS_COLS, NBT=STATS_BAND_TILE, num_warps=STATS_WARPS, **flags)
        upd_cfg = dict(G=cfg["G"], MB=self.layout.block, FULL=self.full, ROWS=cfg["ROWS"], PREFETCH=cfg["PREFETCH"],
                       num_warps=cfg["num_warps"], **flags)  # fmt: skip
        if cfg["maxnreg"] and self.multi_tensor:  # a CUDA launch option (the interpreter has none)
            upd_cfg["maxnreg"] = cfg["maxnreg"]
        return stats_cfg, upd_cfg

    def _launches(self, scaling: bool, g_table, lr_t, gs, fi, upd: tuple) -> list[tuple]:
        """(phase, (kernel, grid, args, kwargs)) of a step's multi-tensor launches: the stats launch
        where v is factored, the columns launch where rows are split, the update launch. ``upd``: the
        update's float scalars."""
        module = self.kernels(scaling)
        stats_cfg, upd_cfg = self._launch_configs()
        p_t, m_t, ms_t, v_t, vb_t, row_t, col_t, rn_t, cn_t = self._tables
        tel = self.telemetries[0]
        out = []
        if self.stats_work is not None:
            out.append(("stats", (module.turbo_adam_stats_kernel, (self.stats_work.shape[0],),
                                  (self.stats_work, self.meta, g_table, row_t, col_t, rn_t, cn_t, self.workspace,
                                   self.stats_done, self.band_done, self.stripe_done, self.mean, gs, fi, upd[0],
                                   upd[2]), stats_cfg)))  # fmt: skip
        if self.columns_work is not None:
            out.append(("columns", (module.turbo_adam_columns_kernel, (self.columns_work.shape[0],),
                                    (self.columns_work, self.meta, col_t, cn_t, self.workspace, self.stats_done,
                                     self.mean, fi, upd[0], upd[2]), self._columns_config())))  # fmt: skip
        out.append(("update", (module.turbo_adam_kernel, (self.work.shape[0],),
                               (self.work, self.meta, p_t, g_table, m_t, ms_t, v_t, vb_t, row_t, col_t, rn_t, cn_t,
                                self.workspace, self.steps, self.done, self.mean, tel.launch, lr_t, gs, fi,
                                tel.amax_slots, tel.clip, *upd), upd_cfg)))  # fmt: skip
        return out

    def _single_launches(self, scaling: bool, lr_t, gs, fi, upd: tuple) -> list[tuple]:
        """The interpreter's (phase, launch) pairs: one tensor per launch, as tensor 0 of its tables."""
        module = self.kernels(scaling)
        stats_cfg, upd_cfg = self._launch_configs()
        out = []
        for t, g in enumerate(self.grads()):
            p, m, ms, v, vb, row, col, rn, cn = (ts[t] for ts in self._pointers)
            meta, step, done, mean = self.meta[t:], self.steps[t:], self.done[t:], self.mean[t:]
            tel = self.telemetries[t]
            g = g.contiguous()
            if t in self._bands_of:
                bands = self._bands_of[t]
                out.append(("stats", (module.turbo_adam_stats_kernel, (bands.shape[0],),
                                      (bands, meta, g, row, col, rn, cn, self.workspace, self.stats_done[t:],
                                       self.band_done, self.stripe_done, mean, gs, fi, upd[0], upd[2]),
                                      stats_cfg)))  # fmt: skip
            if t in self._stripes_of:
                out.append(("columns", (module.turbo_adam_columns_kernel, (self._stripes_of[t].shape[0],),
                                        (self._stripes_of[t], meta, col, cn, self.workspace, self.stats_done[t:],
                                         mean, fi, upd[0], upd[2]), self._columns_config())))  # fmt: skip
            work = self._work_of[t]
            out.append(("update", (module.turbo_adam_kernel, (work.shape[0],),
                                   (work, meta, p, g, m, ms, v, vb, row, col, rn, cn, self.workspace, step, done, mean,
                                    tel.launch, lr_t, gs, fi, tel.amax_slots, tel.clip, *upd), upd_cfg)))  # fmt: skip
        return out

    def _columns_config(self) -> dict:
        """The columns launch's compile-time options: stripes as the stats launch's."""
        return dict(TC=STATS_COLS, ALIGNED=self.aligned, num_warps=STATS_WARPS)

    def _precompile(self) -> None:
        """Queue both variants' launches (with and without GradScaler's tensors) for their background
        compile (precompile.py), GradScaler's behind the rest: a dtype stands for the lr buffer,
        zeros for the floats."""
        for scaling in (False, True):
            self._warm[scaling] = precompile.warm_launches(self._placeholder_launches(scaling), self.device,
                                                           later=scaling)  # fmt: skip

    def _placeholder_launches(self, scaling: bool) -> list[tuple]:
        """A step's launches under the current config, a dtype standing for the lr buffer and zeros
        for the floats (what a background compile needs)."""
        launches = self._launches(scaling, self._grads.table, torch.float32, self._one, self._zero, (0.0,) * 9)
        return [launch for _, launch in launches]

    def warm_config(self, config) -> list[precompile.Warm]:
        """Compile the launches (without GradScaler's tensors) of ``config`` in the background and
        stay on the current config (the tuner's compile-ahead); nothing to do off CUDA."""
        if self._grads is None:  # the interpreter's single-tensor launches
            return []
        return precompile.warm_config(self, config, lambda: self._placeholder_launches(False))

    def update_amax(self) -> Tensor:
        """The last step's largest |update| of this launch's tensors (0-d fp32, no sync)."""
        return torch.stack([t.amax() for t in self.telemetries]).max()

    def clipped(self) -> Tensor:
        """Elements whose fresh v fell outside the factored codes' range at the last step (0-d int64)."""
        return torch.stack([t.clipped() for t in self.telemetries]).sum()

    def configure(self, config) -> None:
        """Launch with ``config`` from now on (the tuner and benchmarks try configs this way)."""
        self.config = dict(TURBO_ADAM.check_config(config))
        self._build([int(s) for s in self.meta[: self.n_coded, 3].tolist()])


class TurboGroupPlan:
    """How one param group steps: fused launches (one per layout, device, dtype and sharded or not;
    on CUDA the group's plain exact tensors of that device and dtype ride in the largest plain one),
    AdamW's stepper for exact tensors left over, and the PyTorch reference for what the kernels do not
    take (block sizes the tiles cannot hold, non-contiguous or empty tensors or local shards, the CPU
    under ``auto``). Sharded params here are compressed ones: matrices whose rows alone are split."""

    def __init__(self, key: tuple, params: list[Tensor], state: dict, layouts: list[Layout], seeds: list[int],
                 mode: str) -> None:  # fmt: skip
        self.key = key
        fused: dict[tuple, list[int]] = {}
        exact: list[int] = []
        self.reference: list[int] = []  # indices into params
        paths = {}
        for i, (p, layout) in enumerate(zip(params, layouts, strict=True)):
            if layout.exact:
                exact.append(i)
                continue
            path = "reference"
            mine = local(p)
            if mine.numel() and kernel_block(layout.block):
                path = kernel_path(mine, mode)
            if path in ("cuda", "interpreter"):
                _contiguous_state(state[p])
                key = (layout, mine.device, mine.dtype, isinstance(p, DTensor))
                fused.setdefault(key, []).append(i)
                paths[key] = path
            else:
                self.reference.append(i)
        self.launches: list[TurboLaunch] = []
        riders = {}  # (device, dtype) -> exact params that ride in a fused CUDA launch
        for i in exact:
            p = params[i]
            if kernel_path(p, mode) == "cuda" and not isinstance(p, DTensor) and p.numel() and _exact_ready(state[p]):
                riders.setdefault((p.device, p.dtype), []).append(i)
        taken = set()
        for k in sorted(fused, key=lambda k: -sum(params[i].numel() for i in fused[k])):
            idx = fused[k]
            ride = riders.pop((k[1], k[2]), []) if paths[k] == "cuda" and not k[3] else []
            taken.update(ride)
            self.launches.append(TurboLaunch([params[i] for i in idx], [state[params[i]] for i in idx], k[0],
                                             [seeds[i] for i in idx], tuple(params[i] for i in ride),
                                             tuple(state[params[i]] for i in ride), paths[k] == "cuda"))  # fmt: skip
        self.exact = [params[i] for i in exact if i not in taken]  # AdamW's stepper

    def update_amax(self) -> Tensor:
        """The fused launches' largest |update| of the last step (0-d, on the first launch's device)."""
        device = self.launches[0].device
        return torch.stack([launch.update_amax().to(device) for launch in self.launches]).max()

    def clipped(self) -> Tensor:
        """Factored codes clipped at the last step over the fused launches (0-d int64)."""
        device = self.launches[0].device
        return torch.stack([launch.clipped().to(device) for launch in self.launches]).sum()


def _contiguous_state(state: dict) -> None:
    """A loaded checkpoint may hold views: the kernels need contiguous state (a sharded state's local
    tensor; a DTensor made contiguous keeps its placements)."""
    for key, t in state.items():
        if isinstance(t, Tensor) and key != "step" and not local(t).is_contiguous():
            state[key] = t.contiguous()


def _exact_ready(state: dict) -> bool:
    """Whether an exact tensor's AdamW state is what the fused launch reads: contiguous fp32, aligned."""
    return all(k in state and state[k].dtype == torch.float32 and state[k].is_contiguous()
               and state[k].data_ptr() % 16 == 0 for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
