"""The multi-level linear attention's Triton kernels and their autograd Function.

Forward: a sequential chunk-state pass (one program per folded head) plus a parallel output pass
(one per chunk); it keeps each level's output y and denominator in fp32 for the backward, which
recomputes the chunk states, runs the reverse recurrence for (dS, dz) and then a parallel gradient
pass. A one-launch decode kernel serves short calls (T ≤ 16) without autograd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend

__all__ = ["BWD_CHUNK", "FWD_CHUNK", "linear_attention_triton", "state_split"]


# Folded head index n = (b·Lv + l)·H + h. Chunk-state buffers: [B, Lv, H, NC, D, D] / [.., D] fp32.
#
# Dot operands are the input dtype DT, but SDT = fp32 for fp16 inputs (tf32 on the GPU) in the dots
# that meet the state S, its gradient dS, dnum = dO·w/den or dA: S and den grow with the tokens seen
# (γ = 1) past fp16's 65504, and dnum, dA and dS (sums of dnum) shrink below its smallest normal, 6e-5.
# bf16 has fp32's range and keeps DT.
# The products with the carried state itself, f(q)·S_c (the output) and dnum·S_cᵀ (dq), need more:
# with γ = 1, S ≈ z·v̄ᵀ grows with the N tokens seen, while dq = (S·dnum − (dnum·y)·z) is the size of v's
# spread σ around its mean v̄: its two terms cancel. S rounded to bf16 (or tf32) costs dq a relative
# error that grows as 2⁻⁹·√N·|v̄|/σ, of order one by N = 8192 tokens when v̄ = σ. So in low
# precision (SDROP > 0) S is split into two dot operands, hi = S rounded and lo = S − hi (together S
# to ~2⁻¹⁷), and the other operand is rounded once (:func:`_round_mantissa`) and used as rounded in
# both cancelling terms: f(q) in the numerator and the denominator, dnum in dnum·Sᵀ and in
# dden = −dnum·y (and in the reverse recurrence's dS and dz); dq is then the derivative at that
# rounded dnum. (Plain fp32 operands at "tf32x3" would do too, but spill 300 B of registers in
# bf16.) Every other fp32 operand of a tf32 dot is rounded to nearest too (:func:`_operand`), as
# Hopper's tensor cores truncate it. Likewise z sums f(k) as rounded for S's dot, and the
# denominator sums the intra-chunk A as rounded for the numerator's (the ones column beside v of the
# PyTorch path does both by construction): unrounded sums make fp16 dq's error 8x the reference's
# over one call of 2,048 tokens.

_DECODE_MAX_T = 16


def state_split(x: torch.Tensor) -> int:
    """SDROP: mantissa bits the state dots' operands drop for inputs like x (bf16: 16; fp16, whose
    state dots run in tf32: 13), 0 for fp32 (IEEE dots, nothing split or rounded)."""
    return {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}[x.dtype]



# The parallel kernels have no loop to pipeline and hold many [BT, BD] fp32 tiles: compiled ahead
# of time for sm_90 (python -m fractus.bench aot), 4 warps spill registers in bf16 and fp32; 8 warps
# spill at most 116 bytes in bf16 at the chunk lengths the model takes (results/aot_sm90.csv), so
# they launch with 8 warps, untuned.
_PARALLEL_WARPS = 8


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    """fp32 x rounded to nearest (ties away from 0) at 23 − DROP mantissa bits, kept in fp32: the
    exact value a bf16 (DROP 16) or tf32 (DROP 13) dot operand holds; NaN stays NaN (its bits
    would carry into the sign or the exponent)."""
    b = x.to(tl.uint32, bitcast=True) + (1 << (DROP - 1))
    return tl.where(x == x, ((b >> DROP) << DROP).to(tl.float32, bitcast=True), x)


@triton.jit
def _operand(x, SDT: tl.constexpr, SDROP: tl.constexpr):
    """fp32 x as an SDT dot operand, rounded to nearest. In a tf32 dot (fp16 inputs: SDT fp32,
    SDROP 13) that takes :func:`_round_mantissa`: Hopper's tensor cores truncate a tf32 operand's
    low 13 bits, a bias that made fp16 gradients 3x less accurate than PyTorch's fp16 ones."""
    if SDROP == 13:
        return _round_mantissa(x, SDROP)
    return x.to(SDT)


@triton.jit
def _state_dot(a, S, SDT: tl.constexpr, PREC: tl.constexpr, SDROP: tl.constexpr):
    """a [BT, BD] (fp32, already rounded by :func:`_round_mantissa` when SDROP > 0) · S [BD, BD]
    fp32, with S split into hi + lo operands in low precision (see the note on the state dots)."""
    if SDROP > 0:
        hi = _round_mantissa(S, SDROP)
        return (tl.dot(a.to(SDT), hi.to(SDT), input_precision=PREC)
                + tl.dot(a.to(SDT), _operand(S - hi, SDT, SDROP), input_precision=PREC))
    return tl.dot(a, S, input_precision=PREC)


@triton.jit
def _feature(x, om, mask):
    """f(x) = elu(x + ω) + 1 in fp32, 0 where masked (padding must not enter the state)."""
    u = x + om
    return tl.where(mask, tl.where(u > 0, u + 1.0, tl.exp(u)), 0.0)


@triton.jit
def _level_features(qx, kx, om_ptr, l, mask):
    """Level l's shift ω_l and the features f(q), f(k) of the chunk's tiles."""
    om = tl.load(om_ptr + l)
    return om, _feature(qx, om, mask), _feature(kx, om, mask)


@triton.jit
def _state_index(D, BD: tl.constexpr):
    """rd [BD], its mask, and the [BD, BD] mask and offsets of one D×D state."""
    rd = tl.arange(0, BD)
    dmask = rd < D
    return rd, dmask, dmask[:, None] & dmask[None, :], rd[:, None] * D + rd[None, :]


@triton.jit
def _load_state(s_ptr, z_ptr, n, D, BD: tl.constexpr, PRESENT: tl.constexpr):
    """(S [BD, BD], z [BD]) fp32 of folded head n from [.., D, D] / [.., D] buffers, or zeros."""
    rd, dmask, smask, soff = _state_index(D, BD)
    if PRESENT:
        S = tl.load(s_ptr + n * D * D + soff, mask=smask, other=0.0)
        z = tl.load(z_ptr + n * D + rd, mask=dmask, other=0.0)
    else:
        S = tl.zeros([BD, BD], dtype=tl.float32)
        z = tl.zeros([BD], dtype=tl.float32)
    return S, z


@triton.jit
def _chunk_index(T, H, D, NC, BT: tl.constexpr, BD: tl.constexpr):
    """Program (b·H + h)·NC + c of the parallel kernels' 1-D grid (one axis: CUDA caps the others
    at 65,535, which B·H passes): chunk c, rt [BT], t = c·BT + rt and its mask, the [BT, BD] mask
    m2, and the [BT, BD] offsets of the chunk in one [T, H, D] (row) and in x [B, T, H, D] (off)."""
    pid = tl.program_id(0)
    c = pid % NC
    bh = (pid // NC).to(tl.int64)
    b = bh // H
    h = bh % H
    rt = tl.arange(0, BT)
    rd, dmask, smask, soff = _state_index(D, BD)
    t = c * BT + rt
    tmask = t < T
    row = h * D + t.to(tl.int64)[:, None] * H * D + rd[None, :]
    return c, bh, b, h, rt, t, tmask, tmask[:, None] & dmask[None, :], row, b * T * H * D + row


@triton.jit
def _load_qkv(q_ptr, k_ptr, v_ptr, off, m2):
    """The chunk's q, k (fp32) and v (input dtype) tiles [BT, BD], 0 where masked."""
    return (tl.load(q_ptr + off, mask=m2, other=0.0).to(tl.float32),
            tl.load(k_ptr + off, mask=m2, other=0.0).to(tl.float32), tl.load(v_ptr + off, mask=m2, other=0.0))


@triton.jit
def _chunk_decays(lg_ptr, b, l, h, t, rt, L, sb, st, sl, sh, PER_POS: tl.constexpr):
    """The decays within a chunk of L positions t = c·BT + rt, from the log-decays lg[b, t, l, h] at
    strides (sb, st, sl, sh): gq [BT] from the chunk's start through each position, gk [BT] from
    each position to the chunk's end (0 past it), gL through the whole chunk, and the causal mask
    M [BT, BT], M_ts the decay from s to t (t ≥ s, else 0). A fixed decay (not PER_POS) gives
    γ^{t+1}, γ^{L−1−s}, γ^L and γ^{t−s}. A decay per position sums its logarithms in fp64 (b, the
    sum through each position) and takes differences of b as two fp32 halves, so that M and gk keep
    fp32's relative accuracy however far b has run."""
    gap = rt[:, None] - rt[None, :]
    causal = gap >= 0
    if PER_POS:
        lgv = tl.load(lg_ptr + b * sb + t.to(tl.int64) * st + l * sl + h * sh, mask=rt < L, other=0.0)
        bc = tl.cumsum(lgv.to(tl.float64), 0)
        hi = bc.to(tl.float32)
        lo = (bc - hi.to(tl.float64)).to(tl.float32)
        hL, lL = tl.sum(tl.where(rt == L - 1, hi, 0.0), 0), tl.sum(tl.where(rt == L - 1, lo, 0.0), 0)
        gq = tl.exp(hi)
        gk = tl.where(rt < L, tl.exp((hL - hi) + (lL - lo)), 0.0)
        gL = tl.exp(hL)
        diff = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
        M = tl.where(causal, tl.exp(tl.where(causal, diff, 0.0)), 0.0)
    else:
        lg = tl.load(lg_ptr + l * sl + h * sh)
        gq = tl.exp(lg * (rt + 1).to(tl.float32))
        gk = tl.where(rt < L, tl.exp(lg * tl.maximum(L - 1 - rt, 0).to(tl.float32)), 0.0)
        gL = tl.exp(lg * L.to(tl.float32))
        M = tl.where(causal, tl.exp(lg * tl.maximum(gap, 0).to(tl.float32)), 0.0)
    return gq, gk, gL, M


@triton.autotune(configs=_backend.sequential_configs(), key=["BT", "BD"])
@triton.jit
def _la_states_kernel(k_ptr, v_ptr, om_ptr, lg_ptr, s0_ptr, z0_ptr, hs_ptr, zs_ptr, sf_ptr, zf_ptr,
                      T, H, D, NC, sb, st, sl, sh, LV: tl.constexpr, PER_POS: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr):
    """Sequential over chunks for one folded head: stores each chunk's starting (S, z), then
    S ← g·S + (g_s f(k))ᵀ v, z likewise, with g the chunk's whole decay and g_s the decay from
    position s to the chunk's end; optional final state."""
    DT = v_ptr.dtype.element_ty
    n = tl.program_id(0).to(tl.int64)
    h = n % H
    l = (n // H) % LV
    b = n // (H * LV)
    om = tl.load(om_ptr + l)
    rt = tl.arange(0, BT)
    rd, dmask, smask, soff = _state_index(D, BD)
    S, z = _load_state(s0_ptr, z0_ptr, n, D, BD, HAS_INIT)
    base = b * T * H * D + h * D
    for c in range(NC):
        hoff = n * NC + c
        tl.store(hs_ptr + hoff * D * D + soff, S, mask=smask)
        tl.store(zs_ptr + hoff * D + rd, z, mask=dmask)
        t = c * BT + rt
        m2 = (t < T)[:, None] & dmask[None, :]
        off = base + t.to(tl.int64)[:, None] * H * D + rd[None, :]
        fk = _feature(tl.load(k_ptr + off, mask=m2, other=0.0).to(tl.float32), om, m2)
        vx = tl.load(v_ptr + off, mask=m2, other=0.0)
        L = tl.minimum(T - c * BT, BT)
        _, gk, gamL, _ = _chunk_decays(lg_ptr, b, l, h, t, rt, L, sb, st, sl, sh, PER_POS)
        fk = (fk * gk[:, None]).to(DT)
        S = S * gamL + tl.dot(tl.trans(fk), vx, input_precision=PREC)
        z = z * gamL + tl.sum(fk.to(tl.float32), 0)
    if STORE_FINAL:
        tl.store(sf_ptr + n * D * D + soff, S, mask=smask)
        tl.store(zf_ptr + n * D + rd, z, mask=dmask)


@triton.jit
def _la_out_kernel(q_ptr, k_ptr, v_ptr, w_ptr, om_ptr, lg_ptr, hs_ptr, zs_ptr, o_ptr, y_ptr, den_ptr,
                   B, T, H, D, NC, eps, sb, st, sl, sh, LV: tl.constexpr, PER_POS: tl.constexpr,
                   NORM: tl.constexpr, STORE_Y: tl.constexpr, PREC: tl.constexpr, SDROP: tl.constexpr, BT: tl.constexpr,
                   BD: tl.constexpr):
    """One (chunk, b, h) over all levels: num = (g_t f(q)) S_c + (f(q) f(k)ᵀ ∘ M) v, den the
    same with z_c and a ones column (g_t the decay from the chunk's start through t, M_ts the decay
    from s to t, t ≥ s); o = Σ_l w_l y_l with y_l = num/(den + eps)
    (NORM) or num. With STORE_Y, per-level y [Lv, B, T, H, D] and (NORM) den [B, Lv, H, T] (fp32)
    are kept for backward."""
    DT = v_ptr.dtype.element_ty
    SDT = tl.float32 if DT == tl.float16 else DT
    c, bh, b, h, rt, t, tmask, m2, row, off = _chunk_index(T, H, D, NC, BT, BD)
    rd, dmask, smask, soff = _state_index(D, BD)
    qx, kx, vx = _load_qkv(q_ptr, k_ptr, v_ptr, off, m2)
    o = tl.zeros([BT, BD], dtype=tl.float32)
    L = tl.minimum(T - c * BT, BT)
    for l in tl.static_range(LV):
        gq, _, _, M = _chunk_decays(lg_ptr, b, l, h, t, rt, L, sb, st, sl, sh, PER_POS)
        om, fq, fk = _level_features(qx, kx, om_ptr, l, m2)
        n = (b * LV + l) * H + h
        hoff = n * NC + c
        S = tl.load(hs_ptr + hoff * D * D + soff, mask=smask, other=0.0)
        z = tl.load(zs_ptr + hoff * D + rd, mask=dmask, other=0.0)
        qd = fq * gq[:, None]
        if SDROP > 0:  # the query the state dot sees, in the denominator too
            qd = _round_mantissa(qd, SDROP)
        A = tl.dot(fq.to(DT), tl.trans(fk.to(DT)), input_precision=PREC) * M
        if SDROP > 0:  # A as rounded to DT for the numerator's dot (bf16 and fp16 both drop SDROP
            # bits; fp16's subnormals below 6e-5 lose more), and so summed in the denominator
            A = _round_mantissa(A, SDROP)
        y = _state_dot(qd, S, SDT, PREC, SDROP)
        y += tl.dot(A.to(DT), vx, input_precision=PREC)
        if NORM:
            den = tl.sum(qd * z[None, :], 1) + tl.sum(A, 1)
            y = y / (tl.where(tmask, den, 1.0) + eps)[:, None]  # padding rows: 0, not 0/0 when eps = 0
        o += tl.load(w_ptr + l).to(tl.float32) * y
        if STORE_Y:
            tl.store(y_ptr + (l * B + b) * T * H * D + row, y, mask=m2)
            if NORM:
                tl.store(den_ptr + n * T + t, den, mask=tmask)
    tl.store(o_ptr + off, o.to(o_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _out_grads(do, y, den_ptr, n, T, t, tmask, wl, eps, NORM: tl.constexpr):
    """dy = w_l·dO split into the numerator grad dnum [BT, BD] and the denominator grad dden [BT]
    (0 without the denominator)."""
    if NORM:
        den = tl.load(den_ptr + n * T + t, mask=tmask, other=1.0)  # padding rows: dnum = 0, not 0/0
        inv = wl / (den + eps)
        return do * inv[:, None], -tl.sum(do * y, 1) * inv
    return do * wl, tl.zeros_like(tl.sum(do, 1))


@triton.autotune(configs=_backend.sequential_configs(), key=["BT", "BD"])
@triton.jit
def _la_bwd_states_kernel(q_ptr, do_ptr, y_ptr, den_ptr, w_ptr, om_ptr, lg_ptr, dsf_ptr, dzf_ptr,
                          dhs_ptr, dzs_ptr, ds0_ptr, dz0_ptr, B, T, H, D, NC, eps, sb, st, sl, sh,
                          LV: tl.constexpr, PER_POS: tl.constexpr, NORM: tl.constexpr, HAS_DFINAL: tl.constexpr,
                          STORE_DINIT: tl.constexpr, PREC: tl.constexpr, SDROP: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr):
    """Reverse recurrence for one folded head: stores the grad of each chunk's end state, then
    dS ← g·dS + (g_t f(q))ᵀ dnum, dz ← g·dz + (g_t f(q))ᵀ dden (g the chunk's whole decay, g_t
    from its start through t); optional initial-state grad.
    dz sums the dot operands' rounded values (see the note on the state dots)."""
    SDT = tl.float32 if q_ptr.dtype.element_ty == tl.float16 else q_ptr.dtype.element_ty
    n = tl.program_id(0).to(tl.int64)
    h = n % H
    l = (n // H) % LV
    b = n // (H * LV)
    om = tl.load(om_ptr + l)
    wl = tl.load(w_ptr + l).to(tl.float32)
    rt = tl.arange(0, BT)
    rd, dmask, smask, soff = _state_index(D, BD)
    dS, dz = _load_state(dsf_ptr, dzf_ptr, n, D, BD, HAS_DFINAL)
    base = b * T * H * D + h * D
    for i in range(NC):
        c = NC - 1 - i
        hoff = n * NC + c
        tl.store(dhs_ptr + hoff * D * D + soff, dS, mask=smask)
        tl.store(dzs_ptr + hoff * D + rd, dz, mask=dmask)
        t = c * BT + rt
        tmask = t < T
        m2 = tmask[:, None] & dmask[None, :]
        off = base + t.to(tl.int64)[:, None] * H * D + rd[None, :]
        gq, _, gamL, _ = _chunk_decays(lg_ptr, b, l, h, t, rt, tl.minimum(T - c * BT, BT), sb, st, sl, sh, PER_POS)
        qd = _feature(tl.load(q_ptr + off, mask=m2, other=0.0).to(tl.float32), om, m2) * gq[:, None]
        do = tl.load(do_ptr + off, mask=m2, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + l * B * T * H * D + off, mask=m2, other=0.0)
        dnum, dden = _out_grads(do, y, den_ptr, n, T, t, tmask, wl, eps, NORM)
        qd, dnum = _operand(qd, SDT, SDROP), _operand(dnum, SDT, SDROP)
        if SDROP > 0 and NORM:
            dden = -tl.sum(dnum.to(tl.float32) * y, 1)
        dS = dS * gamL + tl.dot(tl.trans(qd), dnum, input_precision=PREC)
        dz = dz * gamL + tl.sum(qd.to(tl.float32) * dden[:, None], 0)
    if STORE_DINIT:
        tl.store(ds0_ptr + n * D * D + soff, dS, mask=smask)
        tl.store(dz0_ptr + n * D + rd, dz, mask=dmask)


@triton.jit
def _la_bwd_grads_kernel(q_ptr, k_ptr, v_ptr, do_ptr, y_ptr, den_ptr, w_ptr, om_ptr, lg_ptr,
                         hs_ptr, zs_ptr, dhs_ptr, dzs_ptr, dq_ptr, dk_ptr, dv_ptr, dwp_ptr, db_ptr,
                         B, T, H, D, NC, eps, sb, st, sl, sh, LV: tl.constexpr, PER_POS: tl.constexpr,
                         NORM: tl.constexpr, DDECAY: tl.constexpr, PREC: tl.constexpr, SDROP: tl.constexpr,
                         BT: tl.constexpr, BD: tl.constexpr):
    """One (chunk, b, h) over all levels: dq, dk, dv (inter-chunk terms from S_c, z_c and the
    end-state grads dS, dz; intra-chunk terms through the decay mask), summed over levels with
    the feature-map derivative; per-level Σ dO·y_l into dwp [B·H, NC, Lv] for the level weights.
    With DDECAY, per level and position t of the chunk the gradient of log γ_t into db [B, Lv, H, T]:
    the sum over every path from a position s < t to one r ≥ t, which γ_t decays — pairs within
    the chunk (P_rs = dA_rs · f(q_r)·f(k_s), a block's straddling sum), the chunk's start state
    read at r ≥ t, keys s < t written into the end state, and the start state carried through the
    chunk (⟨dS, γ_L S_c⟩). Each term is as small as the paths it counts, so strong decays lose
    nothing to cancellation (the form f(q)·∂f(q) − f(k)·∂f(k) summed from the end cancels large terms)."""
    DT = v_ptr.dtype.element_ty
    SDT = tl.float32 if DT == tl.float16 else DT
    c, bh, b, h, rt, t, tmask, m2, row, off = _chunk_index(T, H, D, NC, BT, BD)
    rd, dmask, smask, soff = _state_index(D, BD)
    qx, kx, vx = _load_qkv(q_ptr, k_ptr, v_ptr, off, m2)
    do = tl.load(do_ptr + off, mask=m2, other=0.0).to(tl.float32)
    L = tl.minimum(T - c * BT, BT)
    dq = tl.zeros([BT, BD], dtype=tl.float32)
    dk = tl.zeros([BT, BD], dtype=tl.float32)
    dv = tl.zeros([BT, BD], dtype=tl.float32)
    # a loop, not unrolled and not pipelined: unrolled, the levels' tiles overlap and spill
    # 72–76 B of registers in bf16 on sm_90; looped, 28–48 B (python -m fractus.bench aot)
    for l in tl.range(LV, num_stages=1):
        gq, gk, gL, M = _chunk_decays(lg_ptr, b, l, h, t, rt, L, sb, st, sl, sh, PER_POS)
        om, fq, fk = _level_features(qx, kx, om_ptr, l, m2)
        n = (b * LV + l) * H + h
        hoff = n * NC + c
        y = tl.load(y_ptr + (l * B + b) * T * H * D + row, mask=m2, other=0.0)
        tl.store(dwp_ptr + (bh * NC + c) * LV + l, tl.sum(tl.sum(do * y, 1), 0))
        dnum, dden = _out_grads(do, y, den_ptr, n, T, t, tmask, tl.load(w_ptr + l).to(tl.float32), eps, NORM)
        if SDROP > 0 and NORM:  # dnum as the state dot sees it, and dden = −dnum·y from the same values
            dnum = _round_mantissa(dnum, SDROP)
            dden = -tl.sum(dnum * y, 1)
        S = tl.load(hs_ptr + hoff * D * D + soff, mask=smask, other=0.0)
        z = tl.load(zs_ptr + hoff * D + rd, mask=dmask, other=0.0)
        dS = tl.load(dhs_ptr + hoff * D * D + soff, mask=smask, other=0.0)
        dz = tl.load(dzs_ptr + hoff * D + rd, mask=dmask, other=0.0)
        dnum_s, vs = dnum.to(SDT), vx.to(SDT)
        fqs, fks, dSs = _operand(fq, SDT, SDROP), _operand(fk, SDT, SDROP), _operand(dS, SDT, SDROP)
        dA = _operand((tl.dot(dnum_s, tl.trans(vs), input_precision=PREC) + dden[:, None]) * M, SDT, SDROP)
        QK = tl.dot(fq.to(DT), tl.trans(fk.to(DT)), input_precision=PREC)
        A = QK * M
        dqs = (_state_dot(dnum, tl.trans(S), SDT, PREC, SDROP) + dden[:, None] * z[None, :]) * gq[:, None]
        dqf = dqs + tl.dot(dA, fks, input_precision=PREC)
        dks = (tl.dot(vs, tl.trans(dSs), input_precision=PREC) + dz[None, :]) * gk[:, None]
        dkf = dks + tl.dot(tl.trans(dA), fqs, input_precision=PREC)
        dvf = tl.dot(fks, dSs, input_precision=PREC) * gk[:, None]
        dvf += tl.dot(tl.trans(_operand(A, SDT, SDROP)), dnum_s, input_precision=PREC)
        if DDECAY:
            P = dA.to(tl.float32) * QK  # [r, s]: the pair's share, lower-triangular
            before = tl.cumsum(P, 1) - P  # [r, t]: Σ_{s < t} P_rs
            within = tl.sum(tl.where(rt[:, None] >= rt[None, :], before, 0.0), 0)  # Σ_{r ≥ t}
            read = tl.sum(fq * dqs, 1)  # the start state read at r
            written = tl.sum(fk * dks, 1)  # key s written into the end state
            carried = gL * (tl.sum(tl.sum(dS * S, 1), 0) + tl.sum(dz * z, 0))
            from_end = tl.sum(read, 0) - tl.cumsum(read, 0) + read  # Σ_{r ≥ t}
            tl.store(db_ptr + n * T + t, within + from_end + (tl.cumsum(written, 0) - written) + carried,
                     mask=tmask)
        # d f / d x = 1 where x + ω > 0, else exp(x + ω) = f (and 0 on padding, where f = 0)
        dq += dqf * tl.where(qx + om > 0, 1.0, fq)
        dk += dkf * tl.where(kx + om > 0, 1.0, fk)
        dv += dvf
    tl.store(dq_ptr + off, dq.to(dq_ptr.dtype.element_ty), mask=m2)
    tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=m2)
    tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _la_decode_kernel(q_ptr, k_ptr, v_ptr, w_ptr, om_ptr, lg_ptr, s0_ptr, z0_ptr, o_ptr, sf_ptr,
                      zf_ptr, T, H, D, eps, sb, st, sl, sh, LV: tl.constexpr, NORM: tl.constexpr,
                      HAS_INIT: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr):
    """One (b, h), all levels, T ≤ TB positions one by one with the state in registers (fp32):
    the recurrence exactly as written; o rows collected in registers, new (S, z) stored."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    rt = tl.arange(0, TB)
    rd, dmask, smask, soff = _state_index(D, BD)
    base = b * T * H * D + h * D
    acc = tl.zeros([TB, BD], dtype=tl.float32)
    for l in tl.static_range(LV):
        om = tl.load(om_ptr + l)
        wl = tl.load(w_ptr + l).to(tl.float32)
        n = (b * LV + l) * H + h
        S, z = _load_state(s0_ptr, z0_ptr, n, D, BD, HAS_INIT)
        for t in range(T):
            off = base + tl.cast(t, tl.int64) * H * D + rd
            fq = _feature(tl.load(q_ptr + off, mask=dmask, other=0.0).to(tl.float32), om, dmask)
            fk = _feature(tl.load(k_ptr + off, mask=dmask, other=0.0).to(tl.float32), om, dmask)
            vx = tl.load(v_ptr + off, mask=dmask, other=0.0).to(tl.float32)
            gam = tl.exp(tl.load(lg_ptr + b * sb + tl.cast(t, tl.int64) * st + l * sl + h * sh))
            S = gam * S + fk[:, None] * vx[None, :]
            z = gam * z + fk
            y = tl.sum(fq[:, None] * S, 0)
            if NORM:
                y = y / (tl.sum(fq * z, 0) + eps)
            acc = tl.where(rt[:, None] == t, acc + wl * y[None, :], acc)
        tl.store(sf_ptr + n * D * D + soff, S, mask=smask)
        tl.store(zf_ptr + n * D + rd, z, mask=dmask)
    tl.store(o_ptr + base + rt.to(tl.int64)[:, None] * H * D + rd[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(rt < T)[:, None] & dmask[None, :])


def _block_d(D):
    if D > 128:
        raise ValueError(f"the Triton linear attention holds a D×D state per program: D <= 128, got {D}")
    return max(16, triton.next_power_of_2(D))


# Chunk lengths. The backward recomputes its chunk states, so it need not use the forward's:
# on chunks of 32 its gradient kernel spills tens of bytes of registers in bf16 on sm_90 instead of
# 1–2.6 KiB on chunks of 64 (python -m fractus.bench aot), at the price of mma.sync instead of
# wgmma; the GPU suite times both (timing_linear_attention.csv, impl triton_bwd64).
FWD_CHUNK, BWD_CHUNK = 64, 32


def _chunk_len(T, most):
    """Chunk length: ``most`` (a power of two ≥ 16), or less for short sequences."""
    return min(most, max(16, triton.next_power_of_2(T)))


_CONST_CACHE: dict = {}


def _const(values, device):
    """A cached fp32 device tensor of python floats (omegas, the log of no decay): no copy per call."""
    key = (tuple(values), str(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return t


def _log_decays(decay, B: int, T: int, Lv: int, H: int, device):
    """log γ as an fp32 tensor and its strides (sb, st, sl, sh) over [B, T, Lv, H], 0 along the
    axes on which the decay does not vary (every axis for None: γ = 1)."""
    if decay is None:
        return _const([0.0], device), (0, 0, 0, 0)
    lg = torch.log(decay.detach().float()).contiguous()
    return lg, {1: (0, 0, 0, 1), 2: (0, 0, H, 1), 3: (T * H, H, 0, 1), 4: (T * Lv * H, Lv * H, H, 1)}[decay.dim()]


def _states(k, v, om, lg, strides, S0, z0, store_final, BT):
    """Chunk-start states ([B, Lv, H, NC, D, D], [.., D]) for chunks of BT and, if asked, the final (S, z)."""
    B, T, H, D = k.shape
    Lv = om.numel()
    BD = _block_d(D)
    NC = triton.cdiv(T, BT)
    dev = k.device
    hs = _backend.empty(B, Lv, H, NC, D, D, dtype=torch.float32, device=dev)
    zs = _backend.empty(B, Lv, H, NC, D, dtype=torch.float32, device=dev)
    sf = _backend.empty(B, Lv, H, D, D, dtype=torch.float32, device=dev) if store_final else hs
    zf = _backend.empty(B, Lv, H, D, dtype=torch.float32, device=dev) if store_final else zs
    _la_states_kernel[(B * Lv * H,)](
        k, v, om, lg, S0 if S0 is not None else hs,
        z0 if z0 is not None else zs, hs, zs, sf, zf, T, H, D, NC, *strides, LV=Lv, PER_POS=strides[1] > 0,
        HAS_INIT=S0 is not None, STORE_FINAL=store_final, PREC=_backend.dot_precision(v), BT=BT, BD=BD)
    return hs, zs, sf, zf


class _TritonLinearAttention(torch.autograd.Function):
    """(q, k, v [B, T, H, D] contiguous, w [Lv], S0, z0 fp32 or None, om [Lv], decay None, [H],
    [Lv, H], [B, T, H] or [B, T, Lv, H], eps, normalize: divide by the denominator, need: a backward
    will follow) -> (o [B, T, H, D], S [B, Lv, H, D, D], z [B, Lv, H, D]). The decay's gradient
    is that of its logarithm (the kernels' db: every path each γ_t decays, see
    ``_la_bwd_grads_kernel``), divided by γ."""

    @staticmethod
    def forward(ctx, q, k, v, w, S0, z0, om, decay, eps, normalize, need):
        B, T, H, D = q.shape
        Lv = om.numel()
        BT, BD = _chunk_len(T, FWD_CHUNK), _block_d(D)
        lg, strides = _log_decays(decay, B, T, Lv, H, q.device)
        hs, zs, sf, zf = _states(k, v, om, lg, strides, S0, z0, True, BT)
        NC = triton.cdiv(T, BT)
        o = _backend.empty(B, T, H, D, dtype=q.dtype, device=q.device)
        y = _backend.empty(Lv, B, T, H, D, dtype=torch.float32, device=q.device) if need else o
        den = _backend.empty(B, Lv, H, T, dtype=torch.float32, device=q.device) if need and normalize else hs
        _la_out_kernel[(NC * B * H,)](
            q, k, v, w, om, lg, hs, zs, o, y, den, B, T, H, D, NC, eps, *strides,
            LV=Lv, PER_POS=strides[1] > 0, NORM=normalize, STORE_Y=need, PREC=_backend.dot_precision(v),
            SDROP=state_split(v), BT=BT, BD=BD, num_warps=_PARALLEL_WARPS)
        if need:
            ctx.save_for_backward(q, k, v, w, S0, z0, om, decay, y, den)
            ctx.eps, ctx.normalize = eps, normalize
        ctx.set_materialize_grads(False)
        return o, sf, zf

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, do, dsf, dzf):
        q, k, v, w, S0, z0, om, decay, y, den = ctx.saved_tensors
        eps, normalize = ctx.eps, ctx.normalize
        B, T, H, D = q.shape
        Lv = om.numel()
        BT, BD = _chunk_len(T, BWD_CHUNK), _block_d(D)
        NC = triton.cdiv(T, BT)
        dev = q.device
        lg, strides = _log_decays(decay, B, T, Lv, H, dev)
        do = torch.zeros_like(q) if do is None else do.contiguous()
        has_df = dsf is not None or dzf is not None
        if has_df:
            dsf = torch.zeros(B, Lv, H, D, D, device=dev) if dsf is None else dsf.float().contiguous()
            dzf = torch.zeros(B, Lv, H, D, device=dev) if dzf is None else dzf.float().contiguous()
        hs, zs, _, _ = _states(k, v, om, lg, strides, S0, z0, False, BT)
        dhs = _backend.empty(B, Lv, H, NC, D, D, dtype=torch.float32, device=dev)
        dzs = _backend.empty(B, Lv, H, NC, D, dtype=torch.float32, device=dev)
        dinit = S0 is not None and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
        ds0 = _backend.empty(B, Lv, H, D, D, dtype=torch.float32, device=dev) if dinit else dhs
        dz0 = _backend.empty(B, Lv, H, D, dtype=torch.float32, device=dev) if dinit else dzs
        _la_bwd_states_kernel[(B * Lv * H,)](
            q, do, y, den, w, om, lg, dsf if has_df else dhs, dzf if has_df else dzs, dhs, dzs,
            ds0, dz0, B, T, H, D, NC, eps, *strides, LV=Lv, PER_POS=strides[1] > 0, NORM=normalize,
            HAS_DFINAL=has_df,
            STORE_DINIT=dinit, PREC=_backend.dot_precision(q), SDROP=state_split(q), BT=BT, BD=BD)
        dq = _backend.empty(B, T, H, D, dtype=q.dtype, device=dev)
        dk = _backend.empty(B, T, H, D, dtype=k.dtype, device=dev)
        dv = _backend.empty(B, T, H, D, dtype=v.dtype, device=dev)
        dwp = _backend.empty(B * H, NC, Lv, dtype=torch.float32, device=dev)
        ddecay = ctx.needs_input_grad[7]
        db = _backend.empty(B, Lv, H, T, dtype=torch.float32, device=dev) if ddecay else dwp
        _la_bwd_grads_kernel[(NC * B * H,)](
            q, k, v, do, y, den, w, om, lg, hs, zs, dhs, dzs, dq, dk, dv, dwp, db, B, T, H, D, NC, eps, *strides,
            LV=Lv, PER_POS=strides[1] > 0, NORM=normalize, DDECAY=ddecay, PREC=_backend.dot_precision(v),
            SDROP=state_split(v), BT=BT, BD=BD, num_warps=_PARALLEL_WARPS)
        dw = dwp.sum((0, 1)).to(w.dtype)
        if not dinit:
            ds0 = dz0 = None
        return dq, dk, dv, dw, ds0, dz0, None, _decay_grad(decay, db) if ddecay else None, None, None, None


def _decay_grad(decay, db):
    """d decay [B, T, H] or [B, T, Lv, H] from db [B, Lv, H, T], the gradients of log γ."""
    dlg = db.permute(0, 3, 1, 2)  # [B, T, Lv, H]
    if decay.dim() == 3:
        dlg = dlg.sum(2)
    return (dlg / decay.float()).to(decay.dtype)


def linear_attention_triton(q, k, v, level_weights, omegas, decay, state, eps, normalize=True):
    """Triton path: the decode kernel for T ≤ 16 without autograd, else the chunked Function."""
    B, T, H, D = q.shape
    Lv = len(omegas)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton linear attention takes fp32/fp16/bf16 inputs, got {q.dtype}")
    q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    w = level_weights.contiguous()
    om = _const(omegas, q.device)
    S0 = z0 = None
    if state is not None:
        S0, z0 = state[0].float().contiguous(), state[1].float().contiguous()
    grads = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, w, S0, z0, decay))
    if T <= _DECODE_MAX_T and not grads:
        BD = _block_d(D)
        lg, strides = _log_decays(decay, B, T, Lv, H, q.device)
        o = _backend.empty(B, T, H, D, dtype=q.dtype, device=q.device)
        sf = _backend.empty(B, Lv, H, D, D, dtype=torch.float32, device=q.device)
        zf = _backend.empty(B, Lv, H, D, dtype=torch.float32, device=q.device)
        _la_decode_kernel[(B * H,)](
            q, k, v, w, om, lg, S0 if S0 is not None else sf,
            z0 if z0 is not None else zf, o, sf, zf, T, H, D, eps, *strides, LV=Lv, NORM=normalize,
            HAS_INIT=S0 is not None, TB=triton.next_power_of_2(T), BD=BD, num_warps=4)
        return o, (sf, zf)
    # forward runs under no_grad, and needs_input_grad ignores the caller's mode: `grads` decides
    # whether the backward's tensors are written (not under no_grad, e.g. evaluation)
    o, sf, zf = _TritonLinearAttention.apply(q, k, v, w, S0, z0, om, decay, float(eps), normalize, grads)
    return o, (sf, zf)
