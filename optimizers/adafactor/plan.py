"""Launch plans for Adafactor's fused step (kernel_templates/adafactor.py.j2).

An ``AdafactorLaunch`` steps the parameters of one param group on one device and dtype in three
launches: the stats launch (row and column sums of g² of the factored tensors and their EMAs),
the norm launch (the update's and the parameter's sums of squares, the step's coefficient per
tensor) and the update launch. On CUDA each launch covers all the tensors through pointer
tables; under the interpreter (CPU tests) there is one launch per tensor, whose programs cannot
load addresses. Nothing in ``run`` reads the device: step counts, lr, GradScaler's scale and inf
stay there, so a step can be captured in a CUDA graph.

FSDP2's sharded parameters (dim 0 split on one mesh dim, statistics in the param dtype) take
launches of their own (``split_rows``), in three phases with the shard group's sums between them
(``shared.shard_sums``; the optimizer issues the all-reduces): ``run_stats`` (the rows' statistics;
Σ row_next and the column sums of g² of this rank's rows into ``red1``), ``run_norm`` (the column
statistics and the mean from the added sums; Σ u², Σ p² of this rank's part into ``red2``), ``run``
(the coefficients from the added sums, then the update launch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import ADAFACTOR, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES, LrBuffer, issue, kernel_path, pointer_table, share_step_counts
from ..shared.checks import checked_grads
from ..shared.dtensor import DTensor, local
from ..shared.grad_table import GradTable

META = 12  # the template's int64 fields per tensor of the meta table
CODE_BLOCK = 128  # values per int16 base of the 8-bit statistics (optimizer.BLOCK)
# the stats launch's stripes: TC columns (its iterations are STATS_ROWS x TC, a tunable)
STATS_COLS = 256
STATS_BAND_TILE = 8  # bands the last band of a stripe adds per load (the template's NBT)
ELEMENTWISE_BLOCKS = 4  # code blocks (of 128 values) an elementwise sub-tile holds
MAX_BANDS = 64  # a tall matrix takes longer bands rather than give the column sums more to add


def fused(p: Tensor) -> bool:
    """Whether the kernels take ``p``: a matrix, a vector or a scalar with elements, on a 16-byte
    boundary (the kernels' vector accesses; a tensor of 3+ dims, factored over its last two, takes
    the PyTorch path)."""
    return p.dim() <= 2 and p.numel() > 0 and p.data_ptr() % 16 == 0


class AdafactorLaunch:
    """The fused step of ``params`` (one device and dtype; plain tensors, or all DTensors whose dim 0
    alone is split: their local parts). ``coded``: per param, whether its statistics are 8-bit codes
    (then the launch renders the ``log8`` variant; never for DTensors); ``seeds``: each param's
    random stream (the rounding of its codes); ``momentum``: the first moment's storage dtype
    (Triton's name, in each state's ``exp_avg``), or ``"none"``."""

    def __init__(self, params: list[Tensor], states: list[dict], coded: list[bool], seeds: list[int],
                 multi_tensor: bool = True, momentum: str = "none") -> None:  # fmt: skip
        self.sources = list(params)
        self.params = [local(p).detach() for p in params]
        self.states = list(states)
        # dim 0 split across ranks (FSDP2): sums over rows and elements added over the shard group
        self.split = isinstance(params[0], DTensor)
        if any(isinstance(p, DTensor) != self.split for p in params) or (self.split and any(coded)):
            raise ValueError("AdafactorLaunch: sharded tensors (fp32 statistics) and plain ones take separate launches")
        self._red_views: tuple[dict, dict] = ({}, {})  # tensor -> its ShardSums slots (red1, red2)
        self._step_launches: list[tuple] | None = None  # a split step's launches, run_stats to run
        self.coded = list(coded)
        self.seeds = list(seeds)
        self.multi_tensor = multi_tensor
        dev = self.device = self.params[0].device
        self.steps = share_step_counts(self.states, dev)
        self.lr = LrBuffer(dev)
        self._dummy = torch.zeros(16, dtype=torch.float32, device=dev)
        self._one, self._zero = torch.ones((), device=dev), torch.zeros((), device=dev)
        self.variant = dict(multi_tensor=multi_tensor, param_dtype=TRITON_DTYPES[self.params[0].dtype],
                            state_codec="log8" if any(coded) else "fp32", momentum=momentum,
                            split_rows=self.split)  # fmt: skip
        arch = "cpu" if dev.type == "cpu" else detect_arch(dev)
        total = sum(p.numel() for p in self.params)
        self.config = dict(select(ADAFACTOR, arch, ADAFACTOR.variant(**{**self.variant, "grad_scaling": False}),
                                  self.variant["param_dtype"], total))  # fmt: skip
        self._kernels: dict[bool, object] = {}
        self._warm: dict[bool, list[precompile.Warm]] = {}  # kernels compiling in the background
        self._build()
        if self.multi_tensor:
            self._precompile()

    # -- tables --------------------------------------------------------------------------------
    def _build(self) -> None:
        dev, cfg = self.device, self.config
        br, bc = cfg["ROWS"], cfg["COLS"]
        n = len(self.params)
        meta = torch.zeros((n, META), dtype=torch.int64)
        stats, tiles, stripes = [], [], []
        ws_off = band_slots = stripe_slots = 0
        for t, p in enumerate(self.params):
            factored = p.dim() == 2
            rows, cols = p.shape if factored else (1, p.numel())
            numel = p.numel()
            nbands = row_next = 0
            if factored:
                band_rows = -(-max(cfg["BAND"], -(-rows // MAX_BANDS)) // CODE_BLOCK) * CODE_BLOCK
                nbands, nstripes = -(-rows // band_rows), -(-cols // STATS_COLS)
                b, s = (x.reshape(-1) for x in torch.meshgrid(torch.arange(nbands), torch.arange(nstripes),
                                                             indexing="ij"))  # fmt: skip
                stats.append(torch.stack([torch.full_like(b, t), b, s, band_slots + b, stripe_slots + s], 1))
                stripes.append(torch.stack([torch.full((nstripes,), t), torch.arange(nstripes)], 1))
                band_slots, stripe_slots = band_slots + nbands, stripe_slots + nstripes
                # column partials [bands, cols], row partials [stripes, rows], row_next, col_next, band sums
                stats_off, row_next = ws_off, ws_off + nbands * cols + nstripes * rows
                ws_off = row_next + rows + cols + nbands
                r0, c0 = (x.reshape(-1) for x in torch.meshgrid(torch.arange(0, rows, br), torch.arange(0, cols, bc),
                                                               indexing="ij"))  # fmt: skip
            else:
                band_rows = stats_off = 0
                r0 = c0 = torch.zeros(-(-numel // (br * bc)), dtype=torch.int64)
            ntiles = r0.numel()
            tiles.append(torch.stack([torch.full_like(r0, t), r0, c0, torch.arange(ntiles)], 1))
            meta[t] = torch.tensor([rows, cols, 0 if factored else 1, int(self.coded[t]), numel, nbands, stats_off,
                                    band_rows, ntiles, ws_off, self.seeds[t], row_next])  # fmt: skip
            ws_off += 3 * ntiles  # the norm launch's partials: sums of u², of p², max |u|
        # big tensors first: their programs (and their finishing ones) start early
        order = sorted(range(n), key=lambda t: -self.params[t].numel())
        stats_of = {int(s[0, 0]): s for s in stats}
        work = torch.cat([tiles[t] for t in order]).to(torch.int32)
        stats_work = torch.cat([stats_of[t] for t in order if t in stats_of]).to(torch.int32) if stats else None
        self.work = work.contiguous().to(dev)
        self.stats_work = stats_work.contiguous().to(dev) if stats_work is not None else None
        # the columns launch's (tensor, stripe) items: dim 0 split across ranks only
        self.columns_work = torch.cat(stripes).to(torch.int32).to(dev) if self.split and stripes else None
        if not self.multi_tensor:  # the interpreter's launches, one tensor each
            self._work_of = [work[work[:, 0] == t].contiguous() for t in range(n)]
            self._stats_of = {t: s.to(torch.int32).contiguous() for t, s in stats_of.items()}
            self._stripes_of = {int(s[0, 0]): s.to(torch.int32).contiguous() for s in stripes}
        self.int64 = any(p.numel() >= 2**31 for p in self.params)
        # rows start 16 elements apart: the compiler may load them in vectors
        self.aligned = all(p.shape[-1] % 16 == 0 for p in self.params if p.dim() == 2)
        self.meta = meta.to(dev)
        self.workspace = torch.empty(max(ws_off, 1), dtype=torch.float32, device=dev)
        # max(mean row, eps1), coef, global rows (a vector's elements: the split launches' counts), amax
        self.scal = torch.zeros((n, 4), dtype=torch.float32, device=dev)
        self.scal[:, 2] = torch.tensor([float(p.shape[0]) if p.dim() else 1.0 for p in self.sources])
        self.done = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows_done = torch.zeros(n, dtype=torch.int32, device=dev)
        self.band_done = torch.zeros(max(band_slots, 1), dtype=torch.int32, device=dev)
        self.stripe_done = torch.zeros(max(stripe_slots, 1), dtype=torch.int32, device=dev)
        self._grads = GradTable(dev, n) if self.multi_tensor and dev.type == "cuda" else None
        self._pointers = self._state_pointers()
        if self.multi_tensor:
            self._tables = [pointer_table(ts, dev) for ts in self._pointers]
            if self.split:
                self._red_tables = [pointer_table(ts, dev) for ts in self._red_pointers()]

    def _state_pointers(self) -> list[list[Tensor]]:
        """Per tensor, the tensors behind p, row (row_var, or an elementwise tensor's variance: codes
        or values), row base, col, col base, first moment (values or int8 codes), its block scales
        (the dummy where a tensor has none)."""
        d = self._dummy
        out = [[] for _ in range(7)]
        for p, state in zip(self.params, self.states, strict=True):
            s = {key: local(x) for key, x in state.items()}  # a sharded param's states: their local parts
            first = "row_var" if p.dim() == 2 else "variance"
            row = s.get(f"{first}_codes", s.get(first))
            col = s.get("col_var_codes", s.get("col_var", d))
            base, col_base = s.get(f"{first}_base", d), s.get("col_var_base", d)
            m, m_scale = s.get("exp_avg", s.get("exp_avg_codes", d)), s.get("exp_avg_scale", d)
            for i, x in enumerate((p, row, base, col, col_base, m, m_scale)):
                out[i].append(x)
        return out

    def _red_pointers(self) -> list[list[Tensor]]:
        """Per tensor, its slots of the shard group's sums (red1: Σ row_next and the column sums of a
        matrix; red2: Σ u², Σ p²), the dummy where it has none (or before ``use_shard_sums``)."""
        red1, red2 = self._red_views
        return [[red1.get(t, self._dummy) for t in range(len(self.params))],
                [red2.get(t, self._dummy) for t in range(len(self.params))]]  # fmt: skip

    def use_shard_sums(self, red1: dict[int, Tensor], red2: dict[int, Tensor]) -> None:
        """Dim 0 split across ranks: the slots (by ``id`` of the source param) of ``ShardSums``
        buffers that the launches write this rank's sums into and read the shard group's from."""
        views = tuple({t: r[id(p)] for t, p in enumerate(self.sources) if id(p) in r} for r in (red1, red2))
        if any(v.keys() != old.keys() or any(x is not old[t] for t, x in v.items())
               for v, old in zip(views, self._red_views, strict=True)):  # fmt: skip
            self._red_views = views
            if self.multi_tensor:
                self._red_tables = [pointer_table(ts, self.device) for ts in self._red_pointers()]

    # -- launching -----------------------------------------------------------------------------
    def _load(self, grad_scaling: bool):
        k = self._kernels.get(grad_scaling)
        if k is None:
            k = self._kernels[grad_scaling] = load(ADAFACTOR, ADAFACTOR.variant(**self.variant,
                                                                              grad_scaling=grad_scaling))  # fmt: skip
        return k

    def kernels(self, grad_scaling: bool):
        """The kernels' module, once their background compile (if any, precompile.py) has finished."""
        for warm in self._warm.pop(grad_scaling, ()):
            warm.wait()
        return self._load(grad_scaling)

    def _configs(self) -> tuple[dict, dict]:
        """The stats launch's and the tile launches' constexprs and launch options."""
        cfg = self.config
        flags = dict(ALIGNED=self.aligned, INT64=self.int64)
        stats_cfg = dict(RT=cfg["STATS_ROWS"], TC=STATS_COLS, NBT=STATS_BAND_TILE, num_warps=cfg["STATS_WARPS"],
                         **flags)  # fmt: skip
        # an elementwise tile is stepped EB code blocks at a time (few registers for a rare path)
        eb = min(ELEMENTWISE_BLOCKS, cfg["ROWS"] * cfg["COLS"] // CODE_BLOCK)
        return stats_cfg, dict(BR=cfg["ROWS"], BC=cfg["COLS"], EB=eb, num_warps=cfg["num_warps"], **flags)

    def _multi_tensor_args(self, g_t, lr, gs, fi, floats: tuple, beta1: tuple) -> tuple[tuple, tuple]:
        """The multi-tensor launches' arguments (stats, tiles) before their constexprs. ``floats``:
        sign, beta2_decay, eps1², eps2, d, weight_decay, eps1."""
        sign, beta2_decay, eps1_sq, eps2, d, weight_decay, eps1 = floats
        p_t, row_t, rowb_t, col_t, colb_t, m_t, ms_t = self._tables
        red1, red2 = ((self._red_tables[0],), (self._red_tables[1],)) if self.split else ((), ())
        stats = (self.stats_work, self.meta, g_t, row_t, rowb_t, col_t, colb_t, self.workspace, self.scal, self.steps,
                 self.rows_done, self.band_done, self.stripe_done, gs, fi, beta2_decay, eps1, *red1)  # fmt: skip
        tiles = (self.work, self.meta, p_t, g_t, row_t, rowb_t, self.workspace, self.scal, self.steps, lr, self.done,
                 gs, fi, sign, beta2_decay, eps1_sq, eps2, d, weight_decay,
                 *_momentum_args(self.variant["momentum"], m_t, beta1, ms_t), *red2)  # fmt: skip
        return stats, tiles

    def _precompile(self) -> None:
        """Start compiling the launches' kernels (without GradScaler's tensors) in the background:
        a dtype stands for the lr tensor, zeros for the group's floats (precompile.py)."""
        module = self._load(False)
        beta1 = (0.0,) if self.variant["momentum"] != "none" else ()
        floats = (0.0,) * 7
        stats, tiles = self._multi_tensor_args(self._grads.table, torch.float32, self._one, self._zero, floats, beta1)
        launches = self._phase_launches(module, stats, tiles, torch.float32, self._zero, floats)
        self._warm[False] = precompile.warm_launches([launch for _, launch in launches], self.device)

    def grads(self) -> list[Tensor]:
        return checked_grads(self.sources)

    def run_stats(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """Dim 0 split across ranks: the stats launch (this rank's sums into red1); nothing otherwise.
        The step's launches are formed here once and kept for ``run_norm`` and ``run``."""
        if self.split:
            self._step_launches = self._launches(group, grad_scale, found_inf)
            issue(self._step_launches, ("stats",))

    def run_norm(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """Dim 0 split across ranks, after red1 was added over the shard group: the columns launch and
        the norm launch (this rank's Σ u², Σ p² into red2); nothing otherwise."""
        if self.split:
            issue(self._step_launches or self._launches(group, grad_scale, found_inf), ("columns", "norm"))

    def run(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """One step of every tensor with ``group``'s hyperparameters (torch.optim.Adafactor's); dim 0
        split across ranks: its last phase (after red2 was added over the shard group)."""
        launches = (self._step_launches if self.split else None) or self._launches(group, grad_scale, found_inf)
        self._step_launches = None
        issue(launches, ("coef", "update") if self.split else ("stats", "norm", "update"))

    def _launches(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> list[tuple]:
        """(phase, launch) of every phase of this step (``issue`` runs them)."""
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(self.params[0].dtype).eps if eps1 is None else float(eps1)
        scaling = grad_scale is not None or found_inf is not None
        # without GradScaler the kernels read neither: constants made once, no per-step allocation
        gs = grad_scale.to(self.device) if grad_scale is not None else self._one
        fi = found_inf.to(self.device) if found_inf is not None else self._zero
        module = self.kernels(scaling)
        lr = self.lr(group["lr"])
        sign = -1.0 if group["maximize"] else 1.0
        floats = (sign, float(group["beta2_decay"]), eps1 * eps1, float(eps2), float(group["d"]),
                  float(group["weight_decay"]), eps1)  # fmt: skip
        beta1 = (float(group["beta1"]),) if self.variant["momentum"] != "none" else ()
        if self.multi_tensor:
            stats, tiles = self._multi_tensor_args(self._grads.update(self.sources, self.grads), lr, gs, fi, floats,
                                                   beta1)  # fmt: skip
            return self._phase_launches(module, stats, tiles, lr, fi, floats)
        return self._single_launches(module, lr, gs, fi, floats, beta1)

    def _phase_launches(self, module, stats: tuple, tiles: tuple, lr, fi, floats: tuple) -> list[tuple]:
        """(phase, launch) of the multi-tensor launches, in the order a step issues them (``stats``,
        ``tiles``: ``_multi_tensor_args``'s)."""
        stats_cfg, tile_cfg = self._configs()
        columns, coef = self._finishers(module, lr, fi, floats) if self.split else (None, None)
        stats = (module.adafactor_stats_kernel, (self.stats_work.shape[0],), stats, stats_cfg) \
            if self.stats_work is not None else None  # fmt: skip
        norm, update = ((module.adafactor_tile_kernel, (self.work.shape[0],), tiles, dict(APPLY=apply, **tile_cfg))
                        for apply in (False, True))  # fmt: skip
        out = [("stats", stats), ("columns", columns), ("norm", norm), ("coef", coef), ("update", update)]
        return [(phase, launch) for phase, launch in out if launch is not None]

    def _finishers(self, module, lr, fi, floats: tuple) -> tuple:
        """The split launches' columns launch (None without factored tensors) and coefficient launch,
        multi-tensor: (kernel, grid, args, kwargs) each."""
        _, beta2_decay, _, eps2, d, _, eps1 = floats
        _, _, _, col_t, colb_t, _, _ = self._tables
        red1_t, red2_t = self._red_tables
        columns = None
        if self.columns_work is not None:
            columns = (module.adafactor_columns_kernel, (self.columns_work.shape[0],),
                       (self.columns_work, self.meta, col_t, colb_t, red1_t, self.workspace, self.scal, self.steps, fi,
                        beta2_decay, eps1), dict(TC=STATS_COLS, num_warps=self.config["STATS_WARPS"]))  # fmt: skip
        coef = (module.adafactor_coef_kernel, (len(self.params),),
                (self.meta, red2_t, self.scal, self.steps, lr, fi, eps2, d), dict(num_warps=1))  # fmt: skip
        return columns, coef

    def _single_launches(self, module, lr, gs, fi, floats: tuple, beta1: tuple) -> list[tuple]:
        """The interpreter's (phase, launch) pairs: one tensor per launch, as tensor 0 of its tables."""
        stats_cfg, tile_cfg = self._configs()
        _, beta2_decay, _, eps2, d, _, eps1 = floats
        tail = (gs, fi, *floats[:-1])
        momentum = self.variant["momentum"]
        red1_of, red2_of = self._red_pointers() if self.split else ([], [])
        out = []
        for t, g in enumerate(self.grads()):
            p, row, rowb, col, colb, m, ms = (ts[t] for ts in self._pointers)
            meta, scal, step = self.meta[t:], self.scal[t:], self.steps[t:]
            red1, red2 = ((red1_of[t],), (red2_of[t],)) if self.split else ((), ())
            g = g.contiguous()
            if t in self._stats_of:
                s = self._stats_of[t]
                out.append(("stats", (module.adafactor_stats_kernel, (s.shape[0],),
                                      (s, meta, g, row, rowb, col, colb, self.workspace, scal, step, self.rows_done[t:],
                                       self.band_done, self.stripe_done, gs, fi, beta2_decay, eps1, *red1),
                                      stats_cfg)))  # fmt: skip
            if self.split and t in self._stripes_of:
                s = self._stripes_of[t]
                out.append(("columns", (module.adafactor_columns_kernel, (s.shape[0],),
                                        (s, meta, col, colb, *red1, self.workspace, scal, step, fi, beta2_decay, eps1),
                                        dict(TC=STATS_COLS))))  # fmt: skip
            work = self._work_of[t]
            args = (work, meta, p, g, row, rowb, self.workspace, scal, step, lr, self.done[t:], *tail,
                    *_momentum_args(momentum, m, beta1, ms), *red2)  # fmt: skip
            out.append(("norm", (module.adafactor_tile_kernel, (work.shape[0],), args, dict(APPLY=False, **tile_cfg))))
            if self.split:
                out.append(("coef", (module.adafactor_coef_kernel, (1,),
                                     (meta, *red2, scal, step, lr, fi, eps2, d), {})))  # fmt: skip
            out.append(("update", (module.adafactor_tile_kernel, (work.shape[0],), args, dict(APPLY=True, **tile_cfg))))
        # a phase's launches of every tensor before the next phase's (the sums of all tensors go
        # out between phases)
        order = ("stats", "columns", "norm", "coef", "update")
        return sorted(out, key=lambda x: order.index(x[0]))

    def update_amax(self) -> Tensor:
        """The last step's largest |update| over this launch's tensors (0-d fp32, no sync)."""
        return self.scal[:, 3].max()

    def configure(self, config) -> None:
        """Launch with ``config`` from now on (the tuner and benchmarks try configs this way)."""
        self.config = dict(ADAFACTOR.check_config(config))
        self._build()


def _momentum_args(momentum: str, m, beta1: tuple, m_scale) -> tuple:
    """The update launch's first-moment arguments: (m, beta1), and the block scales for int8."""
    if momentum == "none":
        return ()
    return (m, *beta1, m_scale) if momentum == "int8" else (m, *beta1)


class AdafactorGroupPlan:
    """How one param group steps: one fused launch per (device, dtype, sharded or not) of the
    tensors the kernels take (``fused``, of a DTensor its local part: dim 0 split by FSDP2; on CUDA,
    or under the interpreter with KERNEL_FACTORY_BACKEND=triton), the PyTorch path for the rest
    (``reference``: indices into ``params``; tensors of 3+ dims, empty local parts, a sharded vector
    whose int8 first moment became bf16, the CPU under ``auto``, dtypes the kernels do not take)."""

    def __init__(self, key: tuple, params: list[Tensor], states: list[dict], coded: list[bool], seeds: list[int],
                 mode: str, momentum: str = "none") -> None:  # fmt: skip
        self.key = key
        buckets: dict[tuple, list[int]] = {}
        paths = {}
        self.reference: list[int] = []
        for i, p in enumerate(params):
            mine, sharded = local(p), isinstance(p, DTensor)
            # a sharded vector asked for int8 momentum keeps bf16 (momentum.py): not the launch's variant
            takes = fused(mine) and not (sharded and momentum == "int8" and p.dim() < 2)
            path = kernel_path(mine, mode) if takes else "reference"
            if path in ("cuda", "interpreter"):
                key = (mine.device, mine.dtype, sharded)
                buckets.setdefault(key, []).append(i)
                paths[key] = path
            else:
                self.reference.append(i)
        self.launches = [AdafactorLaunch([params[i] for i in idx], [states[i] for i in idx], [coded[i] for i in idx],
                                         [seeds[i] for i in idx], paths[k] == "cuda", momentum)
                         for k, idx in buckets.items()]  # fmt: skip

    def update_amax(self) -> Tensor:
        """The fused launches' largest |update| of the last step (0-d, on the first launch's device)."""
        device = self.launches[0].device
        return torch.stack([launch.update_amax().to(device) for launch in self.launches]).max()
