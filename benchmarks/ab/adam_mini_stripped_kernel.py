"""How fast can AdamMini's whole-row update move its bytes when nothing but the update is in the
kernel? A stripped kernel (bf16 p and g, E4M3 m through the template's own inline PTX, an fp32 scale
per 128 elements, a per-row second moment, the max |m| of each sub-block and the fallback tests'
guard, reduced; no pointer tables, bf16 pool, fallback tests or head blocks) on one rows x cols tensor, in two forms:

- ``one``: one program per group of ROWS rows (the template's whole-row launches);
- ``persistent``: PER_SM programs per SM, each looping over row groups and issuing the next
  group's loads before this group's reduction (the loads carried in the loop).

    python -m benchmarks.ab.adam_mini_stripped_kernel

Per column count (768 = 512 + 256, 1024, 2048; about 115M elements each), every ROWS x warps with
8-96 elements of a stream per thread, CUDA-graph replays with L2 flushed (the p50). Floor: the
bytes one step moves (p read and written, g read, m read and written, scales and v) over the copy
bandwidth measured in the same process. Prints the best three of each form per column count as
Markdown rows. A study, not the product: the template is ``kernel_templates/adam_mini.py.j2``.
"""

import torch
import triton
import triton.language as tl

from kernel_factory.generator import ADAM_MINI, load
from kernel_factory.generator.timing import copy_bandwidth_tbs, graph_time_ms

SUB = 128
# The template's own E4M3 conversions (inline PTX, four elements per instance).
_FP8 = load(ADAM_MINI, ADAM_MINI.variant(multi_tensor=True, param_dtype="bfloat16", momentum="float8e4nv")).module
_pack, _unpack = _FP8._e4m3_pack, _FP8._e4m3_unpack
SHAPES = ((768, 512, 256, 150_000), (1024, 1024, 0, 112_000), (2048, 2048, 0, 56_000))  # cols, W0, W1, rows


@triton.jit
def _offsets(r0, R, C, c0, ROWS: tl.constexpr, W: tl.constexpr):
    """Offsets and mask of a ROWS x (W // SUB) x SUB tile at row r0, column c0; sub-block indices."""
    NS: tl.constexpr = W // 128
    rows = r0 + tl.arange(0, ROWS)
    cc = c0 + tl.arange(0, NS)[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    offs = rows.to(tl.int64)[:, None, None] * C + cc
    sidx = rows.to(tl.int64)[:, None] * (C // 128) + c0 // 128 + tl.arange(0, NS)[None, :]
    return offs, (rows < R)[:, None, None] & (cc < C), sidx, (rows < R)[:, None]


@triton.jit
def _load(p_ptr, g_ptr, m_ptr, s_ptr, r0, R, C, c0, ROWS: tl.constexpr, W: tl.constexpr):
    """The tile's raw g, p (bf16), m (E4M3 bytes) and scales, all loads issued before any use."""
    offs, mask, sidx, smask = _offsets(r0, R, C, c0, ROWS, W)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    q = tl.load(m_ptr + offs, mask=mask, other=0)
    return g, p, q, tl.load(s_ptr + sidx, mask=smask, other=0.0)


@triton.jit
def _apply(g, p, q, s, coef, p_ptr, m_ptr, s_ptr, r0, R, C, c0, one_minus_beta1, decay,
           ROWS: tl.constexpr, W: tl.constexpr):
    """m and p of one loaded tile updated and stored (m re-scaled per sub-block); the rows' max |m|."""
    offs, mask, sidx, smask = _offsets(r0, R, C, c0, ROWS, W)
    m = _unpack(q) * s[:, :, None]
    m = m + one_minus_beta1 * (g - m)
    tl.store(p_ptr + offs, (p * decay - m * coef[:, None, None]).to(tl.bfloat16), mask=mask)
    amax = tl.max(tl.abs(m), axis=2)
    inv = tl.where(amax > 0, tl.div_rn(448.0 + tl.zeros_like(amax), tl.where(amax > 0, amax, 1.0)), 0.0)
    tl.store(m_ptr + offs, _pack(m * inv[:, :, None]), mask=mask)
    tl.store(s_ptr + sidx, amax / 448.0, mask=smask)
    # The template's per-tile guard of its fallback tests (an element E4M3 stores as a subnormal),
    # reduced but not acted on beyond a count.
    risky = (m != 0) & (tl.abs(m * inv[:, :, None]) < 0.015625)
    return tl.max(amax, axis=1), tl.max(tl.max(tl.max(risky.to(tl.int32), axis=2), axis=1), axis=0)


@triton.jit
def _group(g0, p0, q0, s0, g1, p1, q1, s1, p_ptr, m_ptr, s_ptr, v_ptr, r0, R, C, beta2, one_minus_beta2,
           one_minus_beta1, decay, lr, ROWS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """One row group from its loaded tiles: per-row v from the rows' mean g^2, then both tiles."""
    rows = r0 + tl.arange(0, ROWS)
    a = g0.to(tl.float32)
    sumsq = tl.sum(tl.sum(a * a, axis=2), axis=1)
    if W1 > 0:
        b = g1.to(tl.float32)
        sumsq += tl.sum(tl.sum(b * b, axis=2), axis=1)
    v = beta2 * tl.load(v_ptr + rows, mask=rows < R, other=0.0) + one_minus_beta2 * (sumsq / C)
    tl.store(v_ptr + rows, v, mask=rows < R)
    coef = lr / (tl.sqrt_rn(v) + 1e-8)
    u, risky = _apply(a, p0.to(tl.float32), q0, s0, coef, p_ptr, m_ptr, s_ptr, r0, R, C, 0, one_minus_beta1, decay,
                      ROWS, W0)
    if W1 > 0:
        u1, risky1 = _apply(b, p1.to(tl.float32), q1, s1, coef, p_ptr, m_ptr, s_ptr, r0, R, C, W0, one_minus_beta1,
                            decay, ROWS, W1)
        u, risky = tl.maximum(u, u1), tl.maximum(risky, risky1)
    return tl.max(u, axis=0), risky


@triton.jit
def one_group_kernel(p_ptr, g_ptr, m_ptr, s_ptr, v_ptr, amax_ptr, R, C, beta2, one_minus_beta2, one_minus_beta1,
                     decay, lr, ROWS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Grid: one program per ROWS rows."""
    r0 = tl.program_id(0) * ROWS
    g0, p0, q0, s0 = _load(p_ptr, g_ptr, m_ptr, s_ptr, r0, R, C, 0, ROWS, W0)
    g1, p1, q1, s1 = g0, p0, q0, s0
    if W1 > 0:
        g1, p1, q1, s1 = _load(p_ptr, g_ptr, m_ptr, s_ptr, r0, R, C, W0, ROWS, W1)
    u, risky = _group(g0, p0, q0, s0, g1, p1, q1, s1, p_ptr, m_ptr, s_ptr, v_ptr, r0, R, C, beta2, one_minus_beta2,
                      one_minus_beta1, decay, lr, ROWS, W0, W1)
    tl.atomic_max(amax_ptr + (tl.program_id(0) % 64) * 32, u)
    if risky > 0:
        tl.atomic_add(amax_ptr + 64 * 32, 1.0)


@triton.jit
def persistent_kernel(p_ptr, g_ptr, m_ptr, s_ptr, v_ptr, amax_ptr, R, C, beta2, one_minus_beta2, one_minus_beta1,
                      decay, lr, ROWS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Grid: fewer programs than row groups; each loads its next group before updating this one."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    g0, p0, q0, s0 = _load(p_ptr, g_ptr, m_ptr, s_ptr, pid * ROWS, R, C, 0, ROWS, W0)
    g1, p1, q1, s1 = g0, p0, q0, s0
    if W1 > 0:
        g1, p1, q1, s1 = _load(p_ptr, g_ptr, m_ptr, s_ptr, pid * ROWS, R, C, W0, ROWS, W1)
    umax = 0.0
    nrisky = 0
    for it in range(pid, tl.cdiv(R, ROWS), nprog):
        nxt = (it + nprog) * ROWS  # past R: masked loads of nothing
        h0, t0, n0, z0 = _load(p_ptr, g_ptr, m_ptr, s_ptr, nxt, R, C, 0, ROWS, W0)
        h1, t1, n1, z1 = h0, t0, n0, z0
        if W1 > 0:
            h1, t1, n1, z1 = _load(p_ptr, g_ptr, m_ptr, s_ptr, nxt, R, C, W0, ROWS, W1)
        u, risky = _group(g0, p0, q0, s0, g1, p1, q1, s1, p_ptr, m_ptr, s_ptr, v_ptr, it * ROWS, R, C, beta2,
                          one_minus_beta2, one_minus_beta1, decay, lr, ROWS, W0, W1)
        umax = tl.maximum(umax, u)
        nrisky += risky
        g0, p0, q0, s0, g1, p1, q1, s1 = h0, t0, n0, z0, h1, t1, n1, z1
    tl.atomic_max(amax_ptr + (pid % 64) * 32, umax)
    if nrisky > 0:
        tl.atomic_add(amax_ptr + 64 * 32, 1.0)


def main() -> None:
    bandwidth = copy_bandwidth_tbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, copy {bandwidth:.3f} TB/s\n")
    print("| cols | form | ROWS | warps | programs per SM | ms | % of floor |\n|---|---|---:|---:|---:|---:|---:|")
    for cols, w0, w1, rows in SHAPES:
        p = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn_like(p)
        m = torch.randint(0, 120, (rows, cols), device="cuda", dtype=torch.uint8)  # E4M3 codes of |x| < 240
        s = torch.rand(rows, cols // SUB, device="cuda") * 1e-3
        v = torch.rand(rows, device="cuda")
        amax = torch.zeros(64 * 32 + 1, device="cuda")  # 64 maxima a line apart, a count
        floor_ms = (rows * cols * 8 + rows * (cols // SUB) * 8 + rows * 8) / (bandwidth * 1e9)
        args = (p, g, m, s, v, amax, rows, cols, 0.999, 0.001, 0.1, 0.9999, 1e-3)
        results = []
        for nrows in (1, 2, 4):
            for warps in (1, 2, 4):
                if not 8 <= nrows * cols // (32 * warps) <= 96:
                    continue
                kw = dict(ROWS=nrows, W0=w0, W1=w1, num_warps=warps)
                groups = triton.cdiv(rows, nrows)
                ms = graph_time_ms(lambda kw=kw, n=groups, a=args: one_group_kernel[(n,)](*a, **kw))[1]
                results.append(("one", nrows, warps, "", ms))
                for per_sm in (2, 4, 8, 16):
                    n = min(sms * per_sm, groups)
                    ms = graph_time_ms(lambda kw=kw, n=n, a=args: persistent_kernel[(n,)](*a, **kw))[1]
                    results.append(("persistent", nrows, warps, per_sm, ms))
        for form in ("one", "persistent"):
            for f, nrows, warps, per_sm, ms in sorted((r for r in results if r[0] == form), key=lambda r: r[4])[:3]:
                print(f"| {cols} | {f} | {nrows} | {warps} | {per_sm} | {ms:.4f} | {100 * floor_ms / ms:.1f} |",
                      flush=True)  # fmt: skip
        del p, g, m, s, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
