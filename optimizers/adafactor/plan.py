"""Launch plans for Adafactor's fused step (kernel_templates/adafactor.py.j2).

An ``AdafactorLaunch`` steps the parameters of one param group on one device and dtype in three
launches: the stats launch (row and column sums of g² of the factored tensors and their EMAs),
the norm launch (the update's and the parameter's sums of squares, the step's coefficient per
tensor) and the update launch. On CUDA each launch covers all the tensors through pointer
tables; under the interpreter (CPU tests) there is one launch per tensor, whose programs cannot
load addresses. Nothing in ``run`` reads the device: step counts, lr, GradScaler's scale and inf
stay there, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_factory.generator import ADAFACTOR, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES, LrBuffer, kernel_path, pointer_table, share_step_counts
from ..shared.checks import checked_grads
from ..shared.dtensor import DTensor
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
    """The fused step of ``params`` (one device and dtype). ``coded``: per param, whether its
    statistics are 8-bit codes (then the launch renders the ``log8`` variant); ``seeds``: each
    param's random stream (the rounding of its codes); ``momentum``: the first moment's storage
    dtype (Triton's name, in each state's ``exp_avg``), or ``"none"``."""

    def __init__(self, params: list[Tensor], states: list[dict], coded: list[bool], seeds: list[int],
                 multi_tensor: bool = True, momentum: str = "none") -> None:  # fmt: skip
        self.sources = list(params)
        self.params = [p.detach() for p in params]
        self.states = list(states)
        self.coded = list(coded)
        self.seeds = list(seeds)
        self.multi_tensor = multi_tensor
        dev = self.device = self.params[0].device
        self.steps = share_step_counts(self.states, dev)
        self.lr = LrBuffer(dev)
        self._dummy = torch.zeros(16, dtype=torch.float32, device=dev)
        self._one, self._zero = torch.ones((), device=dev), torch.zeros((), device=dev)
        self.variant = dict(multi_tensor=multi_tensor, param_dtype=TRITON_DTYPES[self.params[0].dtype],
                            state_codec="log8" if any(coded) else "fp32", momentum=momentum)  # fmt: skip
        arch = "cpu" if dev.type == "cpu" else detect_arch(dev)
        total = sum(p.numel() for p in self.params)
        self.config = dict(select(ADAFACTOR, arch, ADAFACTOR.variant(**self.variant, grad_scaling=False),
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
        stats, tiles = [], []
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
        if not self.multi_tensor:  # the interpreter's launches, one tensor each
            self._work_of = [work[work[:, 0] == t].contiguous() for t in range(n)]
            self._stats_of = {t: s.to(torch.int32).contiguous() for t, s in stats_of.items()}
        self.int64 = any(p.numel() >= 2**31 for p in self.params)
        # rows start 16 elements apart: the compiler may load them in vectors
        self.aligned = all(p.shape[-1] % 16 == 0 for p in self.params if p.dim() == 2)
        self.meta = meta.to(dev)
        self.workspace = torch.empty(max(ws_off, 1), dtype=torch.float32, device=dev)
        self.scal = torch.zeros((n, 4), dtype=torch.float32, device=dev)  # max(mean row, eps1), coef, -, amax
        self.done = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows_done = torch.zeros(n, dtype=torch.int32, device=dev)
        self.band_done = torch.zeros(max(band_slots, 1), dtype=torch.int32, device=dev)
        self.stripe_done = torch.zeros(max(stripe_slots, 1), dtype=torch.int32, device=dev)
        self._grads = GradTable(dev, n) if self.multi_tensor and dev.type == "cuda" else None
        self._pointers = self._state_pointers()
        if self.multi_tensor:
            self._tables = [pointer_table(ts, dev) for ts in self._pointers]

    def _state_pointers(self) -> list[list[Tensor]]:
        """Per tensor, the tensors behind p, row (row_var, or an elementwise tensor's variance: codes
        or values), row base, col, col base, first moment (values or int8 codes), its block scales
        (the dummy where a tensor has none)."""
        d = self._dummy
        out = [[] for _ in range(7)]
        for p, s in zip(self.params, self.states, strict=True):
            first = "row_var" if p.dim() == 2 else "variance"
            row = s.get(f"{first}_codes", s.get(first))
            col = s.get("col_var_codes", s.get("col_var", d))
            base, col_base = s.get(f"{first}_base", d), s.get("col_var_base", d)
            m, m_scale = s.get("exp_avg", s.get("exp_avg_codes", d)), s.get("exp_avg_scale", d)
            for i, x in enumerate((p, row, base, col, col_base, m, m_scale)):
                out[i].append(x)
        return out

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
        stats = (self.stats_work, self.meta, g_t, row_t, rowb_t, col_t, colb_t, self.workspace, self.scal, self.steps,
                 self.rows_done, self.band_done, self.stripe_done, gs, fi, beta2_decay, eps1)  # fmt: skip
        tiles = (self.work, self.meta, p_t, g_t, row_t, rowb_t, self.workspace, self.scal, self.steps, lr, self.done,
                 gs, fi, sign, beta2_decay, eps1_sq, eps2, d, weight_decay,
                 *_momentum_args(self.variant["momentum"], m_t, beta1, ms_t))  # fmt: skip
        return stats, tiles

    def _precompile(self) -> None:
        """Start compiling the launches' kernels (without GradScaler's tensors) in the background:
        a dtype stands for the lr tensor, zeros for the group's floats (precompile.py)."""
        module = self._load(False)
        stats_cfg, tile_cfg = self._configs()
        beta1 = (0.0,) if self.variant["momentum"] != "none" else ()
        stats, tiles = self._multi_tensor_args(self._grads.table, torch.float32, self._one, self._zero, (0.0,) * 7,
                                               beta1)  # fmt: skip
        warms = [precompile.warm(module.adafactor_tile_kernel, (self.work.shape[0],), tiles,
                                 dict(APPLY=apply, **tile_cfg), self.device) for apply in (False, True)]  # fmt: skip
        if self.stats_work is not None:
            warms.append(precompile.warm(module.adafactor_stats_kernel, (self.stats_work.shape[0],), stats,
                                         stats_cfg, self.device))  # fmt: skip
        self._warm[False] = warms

    def grads(self) -> list[Tensor]:
        return checked_grads(self.sources)

    def run(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """One step of every tensor with ``group``'s hyperparameters (torch.optim.Adafactor's)."""
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
        tail = (gs, fi, *floats[:-1])
        stats_tail = (gs, fi, float(group["beta2_decay"]), eps1)
        stats_cfg, tile_cfg = self._configs()
        momentum = self.variant["momentum"]
        beta1 = (float(group["beta1"]),) if momentum != "none" else ()
        if self.multi_tensor:
            g_t = self._grads.update(self.sources, self.grads)
            stats, tiles = self._multi_tensor_args(g_t, lr, gs, fi, floats, beta1)
            if self.stats_work is not None:
                module.adafactor_stats_kernel[(self.stats_work.shape[0],)](*stats, **stats_cfg)
            for apply in (False, True):
                module.adafactor_tile_kernel[(self.work.shape[0],)](*tiles, APPLY=apply, **tile_cfg)
            return
        for t, g in enumerate(self.grads()):  # the interpreter: one tensor per launch, as tensor 0
            p, row, rowb, col, colb, m, ms = (ts[t] for ts in self._pointers)
            meta, scal, step = self.meta[t:], self.scal[t:], self.steps[t:]
            g = g.contiguous()
            if t in self._stats_of:
                s = self._stats_of[t]
                module.adafactor_stats_kernel[(s.shape[0],)](
                    s, meta, g, row, rowb, col, colb, self.workspace, scal, step, self.rows_done[t:],
                    self.band_done, self.stripe_done, *stats_tail, **stats_cfg)  # fmt: skip
            work = self._work_of[t]
            for apply in (False, True):
                module.adafactor_tile_kernel[(work.shape[0],)](
                    work, meta, p, g, row, rowb, self.workspace, scal, step, lr, self.done[t:], *tail,
                    *_momentum_args(momentum, m, beta1, ms), APPLY=apply, **tile_cfg)  # fmt: skip

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
    """How one param group steps: one fused launch per (device, dtype) of the tensors the kernels
    take (``fused``; on CUDA, or under the interpreter with KERNEL_FACTORY_BACKEND=triton), the
    PyTorch path for the rest (``reference``: indices into ``params``; tensors of 3+ dims, DTensors,
    the CPU under ``auto``, dtypes the kernels do not take)."""

    def __init__(self, key: tuple, params: list[Tensor], states: list[dict], coded: list[bool], seeds: list[int],
                 mode: str, momentum: str = "none") -> None:  # fmt: skip
        self.key = key
        buckets: dict[tuple, list[int]] = {}
        paths = {}
        self.reference: list[int] = []
        for i, p in enumerate(params):
            path = kernel_path(p, mode) if not isinstance(p, DTensor) and fused(p) else "reference"
            if path in ("cuda", "interpreter"):
                buckets.setdefault((p.device, p.dtype), []).append(i)
                paths[(p.device, p.dtype)] = path
            else:
                self.reference.append(i)
        self.launches = [AdafactorLaunch([params[i] for i in idx], [states[i] for i in idx], [coded[i] for i in idx],
                                         [seeds[i] for i in idx], paths[k] == "cuda", momentum)
                         for k, idx in buckets.items()]  # fmt: skip

    def update_amax(self) -> Tensor:
        """The fused launches' largest |update| of the last step (0-d, on the first launch's device)."""
        device = self.launches[0].device
        return torch.stack([launch.update_amax().to(device) for launch in self.launches]).max()
