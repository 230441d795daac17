"""The registry of kernel families: what the factory can manufacture."""

from __future__ import annotations

from collections.abc import Mapping

from .family import KernelFamily, Tunable

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _adamw_is_legal(c: Mapping[str, int]) -> bool:
    # A program walks CHUNK elements in BLOCK-sized steps; each thread holds
    # BLOCK / (32 * num_warps) elements of five streams, which must be >= 1 and
    # small enough not to spill (16 fp32 elements x 5 streams = 80 registers).
    # num_stages > 1 pipelines the BLOCK loop through shared memory: (num_stages - 1) x BLOCK x 32
    # bytes with fp32 streams (an offline sm90 compile; bf16 takes a quarter), within 227 KB.
    per_thread = c["BLOCK"] // (32 * c["num_warps"])
    pipelined_bytes = (c["num_stages"] - 1) * c["BLOCK"] * 32
    return c["CHUNK"] % c["BLOCK"] == 0 and 1 <= per_thread <= 16 and pipelined_bytes <= 227 * 1024


ADAMW = KernelFamily(
    name="adamw",
    template="adamw.py.j2",
    description="fused Adam / AdamW step (fp32 math), multi-tensor pointer table or one tensor",
    axes={
        # The interpreter cannot load through pointers read from memory, so the
        # single-tensor variant exists for CPU tests and misaligned tensors.
        "multi_tensor": (True, False),
        "param_dtype": _FLOAT_DTYPES,
        "state_dtype": _FLOAT_DTYPES,
        "decoupled": (True, False),  # AdamW (decoupled decay) or Adam (L2 decay)
        "amsgrad": (False, True),
        "maximize": (False, True),
        "grad_scaling": (False, True),  # in-kernel unscale and skip-on-inf
    },
    tuning_axes=("multi_tensor", "state_dtype", "amsgrad"),
    # One 4096x1024 tensor, and the parameter lists of the 134M Llama-style list (bucket 2^27),
    # Qwen2.5-0.5B (2^29), four layers of Llama-2-7B (2^30) and Llama-3.2-1B (2^31)
    # (optimizers/adamw/tune.py).
    tune_sizes=(1 << 22, 1 << 27, 1 << 29, 1 << 30, 1 << 31),
    # Default: the best of a grid sweep on the H200 (134M fp32 list; BLOCK 512-4096, CHUNK
    # 2048-32768, 4 or 8 warps), 94% of the copy-bandwidth floor; the Optuna tune kept it there.
    tunables=(
        Tunable("BLOCK", 512, (256, 512, 1024, 2048, 4096)),
        Tunable("CHUNK", 4096, (1024, 2048, 4096, 8192, 16384, 32768, 65536)),
        Tunable("num_warps", 8, (1, 2, 4, 8, 16)),
        Tunable("num_stages", 1, (1, 2, 3, 4)),
    ),
    is_legal=_adamw_is_legal,
)

def _adam_mini_is_legal(c: Mapping[str, int]) -> bool:
    # A program holds a ROWS x COLS tile of p, g and m (plus the FP8 sub-block statistics):
    # 4 to 32 fp32 elements per thread stream stays in registers; COLS covers whole FP8
    # sub-blocks of 256 (so 128 too).
    per_thread = c["ROWS"] * c["COLS"] // (32 * c["num_warps"])
    return c["COLS"] % 256 == 0 and 4 <= per_thread <= 32


ADAM_MINI = KernelFamily(
    name="adam_mini",
    template="adam_mini.py.j2",
    description="fused Adam-mini step: block second moments, fp32/bf16/FP8 momentum with BF16 fallback",
    axes={
        "multi_tensor": (True, False),  # the single-tensor variant serves the interpreter
        "param_dtype": _FLOAT_DTYPES,
        "momentum": ("float8e4nv", "bfloat16", "float32"),
    },
    tuning_axes=("multi_tensor", "momentum"),
    tune_sizes=(1 << 27, 1 << 29, 1 << 30, 1 << 31),  # the models' lists (workloads.model_at_bucket)
    # Default: one row, one warp (cheap under the interpreter); the tuned picks are in sm90.json.
    # Rows that split into <= 3 power-of-two tiles go to whole-row launches that take ROWS rows per
    # program, fewer where a row is long (optimizers/adam_mini/plan.py: exact_row_shape); COLS tiles the rest.
    tunables=(
        Tunable("ROWS", 1, (1, 2, 4, 8)),
        Tunable("COLS", 256, (256, 512, 1024, 2048, 4096)),
        Tunable("num_warps", 1, (1, 2, 4, 8, 16)),
        Tunable("num_stages", 1, (1, 2, 3, 4)),
    ),
    is_legal=_adam_mini_is_legal,
    # 2 rows x 256 columns, 1 warp: the fastest FP8 config of ten timed on the H200 with the
    # whole-row launches (0.61 ms against 0.65 for the earlier seed, 4 x 256 with 4 warps).
    seed_configs=({"ROWS": 2, "COLS": 256, "num_warps": 1, "num_stages": 1},),
)

_NS_TILES = dict(BLOCK=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)  # the default


def _newton_schulz_is_legal(c: Mapping[str, int | str]) -> bool:
    # impl "torch" ignores the tile tunables: one config of it (the default tiles) is enough.
    if c["impl"] == "torch":
        return all(c[k] == v for k, v in _NS_TILES.items())
    # Shared memory of the pipelined operand tiles (bf16; the fp32 variant, for the interpreter,
    # uses the same configs): stages x (BLOCK x BLOCK_K + BLOCK_K x max(BLOCK, BLOCK_N)) x 2 bytes
    # within the H100/H200's 227 KB per block; at most 256 fp32 accumulators per thread.
    tiles = c["BLOCK"] * c["BLOCK_K"] + c["BLOCK_K"] * max(c["BLOCK"], c["BLOCK_N"])
    return c["num_stages"] * tiles * 2 <= 227 * 1024 and c["BLOCK"] * c["BLOCK_N"] // (32 * c["num_warps"]) <= 256


NEWTON_SCHULZ = KernelFamily(
    name="newton_schulz",
    template="newton_schulz.py.j2",
    description="Newton-Schulz iteration: symmetric X Xᵀ and A Aᵀ + a I (upper tiles only), B X",
    axes={
        "dtype": ("bfloat16", "float32"),  # float32: exact-arithmetic variant for the interpreter
        "variant": ("classic", "hopper"),  # rendered for the config's impl (optimizers/muon/newton_schulz_launch.py)
        # The product of an iteration a config is tuned for: X Xᵀ, c A Aᵀ + b A + a I, B X. The
        # template renders all three kernels whatever its value; it only keys the cache.
        "product": ("gram", "poly", "update"),
        # The batch's short side m as a power of two, clamped to 1024..8192
        # (newton_schulz_launch.side_class); like product, it only keys the cache, matched as the
        # nearest tuned side among the entries nearest in work (nearest_axes). With the work alone,
        # one 2048 x 8192 matrix took the config of the 134M list's joint batch (the same FLOP
        # bucket): 0.84x torch's matmuls on the H200, 1.08x with its own. Matched exactly, a
        # side-2048 joint batch of 2^43 FLOPs (Llama-3.2-1B's MLP matrices) took the single
        # 2048 x 8192 matrix's config (2^38), and Muon's step on that model went from 60 to 79 ms.
        "side": (1024, 2048, 4096, 8192),
    },
    tuning_axes=("dtype", "product", "side"),
    nearest_axes=("side",),
    # FLOPs of one iteration of the batch (newton_schulz_launch.iteration_flops): 1024^2, 6 and 12 x
    # 768 x 2048 (a sharded step's owner batches), 36 x 768 x 2048 (side 1024); 2048^2, 2048 x 8192
    # (side 2048); 4096^2; 8192^2 (optimizers/muon/newton_schulz_tune.py)
    tune_sizes=(1 << 33, 1 << 36, 1 << 37, 1 << 38, 1 << 39, 1 << 42),
    # impl: the classic kernels, the hopper ones (TMA, persistent, pipelined across tiles; sm90 and up),
    # for the symmetric products of one batch the hopper ones split stream-K (NEWTON_SCHULZ_STREAM_K;
    # the update and joint launches take the hopper kernels with its tiles) or torch's matmuls
    # (cuBLAS), whichever the tuner measured fastest for the size. Default:
    # classic with 128 x 256 tiles, the fastest of six configs tried at 4096^2 and 8192^2 on the
    # H200 before tuning.
    tunables=(
        Tunable("impl", "classic", ("classic", "hopper", "torch", "stream_k")),
        Tunable("BLOCK", _NS_TILES["BLOCK"], (64, 128)),
        Tunable("BLOCK_N", _NS_TILES["BLOCK_N"], (64, 128, 256)),
        Tunable("BLOCK_K", _NS_TILES["BLOCK_K"], (32, 64, 128)),
        Tunable("GROUP_M", _NS_TILES["GROUP_M"], (1, 4, 8)),
        Tunable("num_warps", _NS_TILES["num_warps"], (4, 8)),
        Tunable("num_stages", _NS_TILES["num_stages"], (2, 3, 4, 5)),
    ),
    is_legal=_newton_schulz_is_legal,
    # The one torch config (the sampler would seldom draw it), the hopper tiles measured best
    # on the H200 at 4096^2 and 8192^2 (128 x 128 symmetric tiles, 128 x 256 update tiles, 4 stages),
    # the classic ones best at 48 x 768^2 (128 x 128 update tiles, 4 warps; and for c A Aᵀ + b A
    # with K = 768, 32-wide K steps in 5 stages), and the pipelined hopper symmetric kernel's best
    # at 48 x 768^2 and 36 x 768 x 2048 (4 warps, 5 stages; BLOCK_N 128 keeps the update legal),
    # and the stream-K kernel with the same tiles (the fastest of five tried on one 2048 x 8192
    # matrix's Gram product on the H200: 66 µs against the hopper kernel's 91).
    seed_configs=({"impl": "torch", **_NS_TILES}, {**_NS_TILES, "impl": "hopper", "num_stages": 4},
                  {**_NS_TILES, "impl": "classic", "BLOCK_N": 128, "num_warps": 4},
                  {**_NS_TILES, "impl": "classic", "BLOCK_K": 32, "num_stages": 5},
                  {**_NS_TILES, "impl": "hopper", "BLOCK_N": 128, "num_stages": 5, "num_warps": 4},
                  {**_NS_TILES, "impl": "stream_k", "BLOCK_N": 128, "num_stages": 5, "num_warps": 4}),
    impl_templates={"stream_k": "newton_schulz_stream_k"},
)

# The stream-K symmetric product (newton_schulz_stream_k.py.j2, the NS config's impl "stream_k"):
# a family of its own so that newton_schulz.py.j2's source, on which the tuned newton_schulz
# entries (the H100's among them) are hashed, stays the one they were tuned on; its configs are
# newton_schulz's (newton_schulz_launch.py), not tuned here.
NEWTON_SCHULZ_STREAM_K = KernelFamily(
    name="newton_schulz_stream_k",
    template="newton_schulz_stream_k.py.j2",
    description="Newton-Schulz symmetric product with the upper tiles' K loops split evenly over the SMs",
    axes={"dtype": ("bfloat16", "float32")},
    tunables=NEWTON_SCHULZ.tunables,
    is_legal=_newton_schulz_is_legal,
)


def _muon_is_legal(c: Mapping[str, int]) -> bool:
    # A program holds a BLOCK_R x BLOCK_C tile of g and buf (or p and O) and, for a tall matrix,
    # its transpose on the way through shared memory: 4 to 32 elements per thread.
    per_thread = c["BLOCK_R"] * c["BLOCK_C"] // (32 * c["num_warps"])
    return 4 <= per_thread <= 32


MUON = KernelFamily(
    name="muon",
    template="muon.py.j2",
    description="Muon's momentum + bf16 NS batch (transposing tall matrices) and its update, tile by tile",
    axes={
        "multi_tensor": (True, False),  # the single-tensor variant serves the interpreter
        "param_dtype": _FLOAT_DTYPES,
        "nesterov": (True, False),
    },
    tuning_axes=("multi_tensor",),
    # the hidden matrices of the models' lists (workloads.model_at_bucket(hidden=True)): 134M's 84
    # (85M elements), Qwen2.5-0.5B's, Llama-3.2-1B's (Llama-2-7B x 4's share its bucket)
    tune_sizes=(1 << 27, 1 << 29, 1 << 30),
    # Default: 64 x 64 tiles, 4 warps; square tiles keep a transposed tile's reads as long as its
    # writes. The tuned config is in sm90.json.
    tunables=(
        Tunable("BLOCK_R", 64, (16, 32, 64, 128)),
        Tunable("BLOCK_C", 64, (32, 64, 128, 256)),
        Tunable("num_warps", 4, (2, 4, 8)),
    ),
    is_legal=_muon_is_legal,
)

# Sharded Muon's rows of a batch (muon_rows.py.j2): muon.py.j2's kernels and two that place the
# owner's own rows elsewhere. Not tuned: it runs muon's tuned configs (optimizers/muon/sharded_rows.py).
MUON_ROWS = KernelFamily(
    name="muon_rows",
    template="muon_rows.py.j2",
    description="muon's kernels on sharded Muon's rows, the owner's own rows in place in its matrices and O",
    axes=MUON.axes,
    tunables=MUON.tunables,
    is_legal=_muon_is_legal,
)

# Sharded Muon's owner gathers its matrices' row pieces and scatters O's rows back into them
# (muon_owner.py.j2). Not tuned: its tiles fix which elements each partial sum of the norm adds,
# so one config at every size and world size keeps the norm the same bits at any world size.
# 8 x 256 tiles, 4 warps: 16 elements a thread.
MUON_OWNER = KernelFamily(
    name="muon_owner",
    template="muon_owner.py.j2",
    description="sharded Muon's owner: row pieces into whole matrices with the norm's partial sums, and back",
    axes={},
    tunables=(Tunable("BLOCK_R", 8, (8,)), Tunable("BLOCK_C", 256, (256,)), Tunable("num_warps", 4, (4,))),
    is_legal=lambda c: True,
)

def _turbo_adam_is_legal(c: Mapping[str, int]) -> bool:
    # A tile is four planes of G x 32 elements of one row (turbo_adam.py.j2); each thread holds 2 to
    # 8 elements of each plane (fewer and the warps would hold copies of one another's; more and the
    # moments of four planes spill). BAND (rows of a stats program) is rounded up to its tile's rows.
    return c["G"] % c["num_warps"] == 0 and 2 <= c["G"] // c["num_warps"] <= 8


TURBO_ADAM = KernelFamily(
    name="turbo_adam",
    template="turbo_adam.py.j2",
    description="fused TurboAdam step: 4-bit m, factored 2-bit or log 4/8-bit v, decoded and re-encoded in registers",
    axes={
        "multi_tensor": (True, False),  # the single-tensor variant serves the interpreter
        "param_dtype": _FLOAT_DTYPES,
        "m_codec": ("q4", "exact"),
        "v_codec": ("factored", "log4", "log8", "exact"),
        "exact_items": (False, True),  # tensors under the size thresholds ride in the same launch
        "grad_scaling": (False, True),  # in-kernel unscale and skip-on-inf
        # rows split across ranks (FSDP2): the column sums are added over the shard group between
        # the stats launch and a columns launch; the update launch is one process's
        "split_rows": (False, True),
    },
    tuning_axes=("multi_tensor", "m_codec", "v_codec"),
    tune_sizes=(1 << 27, 1 << 29, 1 << 30, 1 << 31),  # the models' lists (workloads.model_at_bucket)
    # Default: tiles of 2 groups (256 columns) of a row with one warp (2 elements of each plane per
    # thread) at most 64 registers, programs of 16 rows x 1 tile, stats bands of 128 rows: the
    # fastest of eight configs timed on the H200 (134M list: fp32 0.79 ms, bf16 0.70 ms; the
    # compiler's own register count takes 0.94 and 0.88); the tuned configs are in sm90.json.
    tunables=(
        Tunable("ROWS", 16, (1, 2, 4, 8, 16, 32)),
        Tunable("G", 2, (2, 4, 8, 16)),
        Tunable("SPAN", 1, (1, 2, 4, 8)),
        Tunable("BAND", 128, (16, 32, 64, 128, 256)),
        Tunable("num_warps", 1, (1, 2, 4)),
        # registers per thread the update launch may use (0: the compiler's choice, 96 to 255 for
        # this tile, and few warps per SM)
        Tunable("maxnreg", 64, (0, 64, 96, 128)),
        # 1: a tile loads the next tile's p, g and codes before its own stores (more registers live)
        Tunable("PREFETCH", 0, (0, 1)),
    ),
    is_legal=_turbo_adam_is_legal,
)

def _adafactor_is_legal(c: Mapping[str, int]) -> bool:
    # A tile is ROWS x COLS elements of a factored tensor, or ROWS x COLS / 128 code blocks of an
    # elementwise one; each thread holds 4 to 32 elements of p, g and u. A stats iteration loads
    # STATS_ROWS x 256 elements of g: 8 to 128 a thread.
    per_thread = c["ROWS"] * c["COLS"] // (32 * c["num_warps"])
    stats_per_thread = c["STATS_ROWS"] * 256 // (32 * c["STATS_WARPS"])
    return 4 <= per_thread <= 32 and 8 <= stats_per_thread <= 128


ADAFACTOR = KernelFamily(
    name="adafactor",
    template="adafactor.py.j2",
    description="fused Adafactor step: factored row/column statistics (8-bit ln codes or fp32), three passes",
    axes={
        "multi_tensor": (True, False),  # the single-tensor variant serves the interpreter
        "param_dtype": _FLOAT_DTYPES,
        "state_codec": ("log8", "fp32"),  # 8-bit ln codes (state_bits=8) or the param dtype's values
        "momentum": ("none", "bfloat16", "float32", "int8"),  # the optional first moment's storage (beta1)
        "grad_scaling": (False, True),  # in-kernel unscale and skip-on-inf
        # rows split across ranks (FSDP2): sums over rows and elements added over the shard group
        # between the launches, their finishers in launches of their own
        "split_rows": (False, True),
    },
    tuning_axes=("multi_tensor", "state_codec"),
    tune_sizes=(1 << 27, 1 << 29, 1 << 30, 1 << 31),  # the models' lists (workloads.model_at_bucket)
    # Default: tiles of 16 rows x 256 columns with 4 warps (32 elements a thread), stats bands of
    # 256 rows: the best of eight configs timed on the H100 for bf16 params and within 2% of the
    # best for fp32 (134M list: fp32 1.11 ms, bf16 0.64 ms); the stats launch's iterations of 16
    # rows x 256 columns with 4 warps: its best for bf16 params and 8-bit statistics among 18
    # timed on the H100 (0.140 ms, 0.177 with 32 rows); the tuned configs are in sm90.json.
    tunables=(
        Tunable("ROWS", 16, (1, 2, 4, 8, 16, 32)),
        Tunable("COLS", 256, (128, 256, 512, 1024)),
        Tunable("num_warps", 4, (1, 2, 4, 8)),
        Tunable("BAND", 256, (128, 256, 512, 1024)),
        Tunable("STATS_ROWS", 16, (8, 16, 32, 64)),
        Tunable("STATS_WARPS", 4, (2, 4, 8)),
    ),
    is_legal=_adafactor_is_legal,
    # 8 x 256 tiles with 2 warps: the fastest of the eight for fp32 params on the H100 (1.10 ms)
    seed_configs=({"ROWS": 8, "COLS": 256, "num_warps": 2, "BAND": 128, "STATS_ROWS": 16, "STATS_WARPS": 4},),
)

FAMILIES: dict[str, KernelFamily] = {
    f.name: f
    for f in (ADAMW, ADAM_MINI, NEWTON_SCHULZ, NEWTON_SCHULZ_STREAM_K, MUON, MUON_ROWS, MUON_OWNER, TURBO_ADAM,
              ADAFACTOR)
}


def get_family(name: str) -> KernelFamily:
    """Look up a family by name; unknown names raise KeyError listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(FAMILIES)}") from None
