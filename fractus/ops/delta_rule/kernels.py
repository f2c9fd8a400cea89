"""The gated delta rule's Triton kernels and their autograd Function.

The kernels run on folded heads n = (b·Lv + l)·H + h, each with its own unit features k̂, q̂
[N, T, D], write strengths β and log-decays g = log γ [N, T]; v [B, H, T, D] is shared by the
levels. The feature maps, the level weights' sum and the folding are PyTorch around them (autograd
carries their gradients). Everything inside runs in fp32: tf32 dots for bf16 inputs, IEEE dots
for fp32 and fp16 ones.

Per chunk of BT positions, with b_t the log-decays summed from the chunk's start through t, the
values the positions write, u_t = β_t (v_t − (γ_t S_{t−1})ᵀ k̂_t), solve
(I + A) U = diag(β) V − diag(β e^b) K̂ S₀ with A_ti = β_t (k̂_t·k̂_i) e^{b_t − b_i} for i < t. With
M = (I + A)⁻¹ (a unit lower-triangular inverse, by forward substitution: the UT transform),
U' = M diag(β) V and W = M diag(β e^b) K̂ depend on the chunk alone, so U = U' − W S₀, and

    y = diag(e^b) Q̂ S₀ + (Q̂K̂ᵀ ⊙ E) U,   S_end = e^{b_C} S₀ + (diag(e^{b_C − b}) K̂)ᵀ U,

E_ti = e^{b_t − b_i} for i ≤ t. A reset cuts a chunk into segments: positions reach each other,
the chunk's start state and its end state only within one (the factors above, masked).

Forward: a parallel pass for M, U', W (:func:`_dr_prepare_kernel`), the sequential pass over chunks
for U and each chunk's start state (:func:`_dr_states_kernel`), a parallel pass for y
(:func:`_dr_output_kernel`). Backward: the sequential reverse pass for dU and the state gradient at
each chunk's end (:func:`_dr_bwd_states_kernel`), then every input's gradient chunk by chunk in
two parallel passes: through the output and the end state (:func:`_dr_bwd_output_kernel`), then
through the triangular solve (:func:`_dr_bwd_solve_kernel`). A one-launch decode kernel runs T ≤ 16 without autograd,
one position at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend
from fractus.ops.delta_rule.reference import check_inputs, unit_features

__all__ = ["CHUNK", "delta_rule_triton"]

CHUNK = 32  # positions per chunk on a GPU (the interpreter's tests pass their own, ≥ 16 for tl.dot)
_DECODE_MAX_T = 16



_PARALLEL_WARPS = 8


@triton.jit
def _chunk(n, c, T, D, BT: tl.constexpr, BD: tl.constexpr):
    """rt [BT], t = c·BT + rt, its mask, rd [BD], the [BT, BD] mask and offsets of chunk c of
    folded head n in an [N, T, D] buffer, and the [BD, BD] mask and offsets of one D×D state."""
    rt = tl.arange(0, BT)
    rd = tl.arange(0, BD)
    t = c * BT + rt
    valid = t < T
    dmask = rd < D
    m2 = valid[:, None] & dmask[None, :]
    off = n * T * D + t.to(tl.int64)[:, None] * D + rd[None, :]
    return rt, t, valid, rd, m2, off, dmask[:, None] & dmask[None, :], rd[:, None] * D + rd[None, :]


@triton.jit
def _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT: tl.constexpr, RESETS: tl.constexpr):
    """The chunk's decays: E [BT, BT] (e^{b_t − b_i} for i ≤ t in one segment, else 0), g0 [BT]
    (e^{b_t}: from the chunk's start state, 0 past the chunk's first reset), gC [BT] (e^{b_C − b_t}:
    to its end state, 0 before its last reset and past T) and gL (e^{b_C}, 0 if the chunk holds a
    reset). b sums the log-decays in fp64 and keeps them as two fp32 halves, so that differences of
    b keep fp32's relative accuracy."""
    g = tl.load(g_ptr + n * T + t, mask=valid, other=0.0)
    bc = tl.cumsum(g.to(tl.float64), 0)
    hi = bc.to(tl.float32)
    lo = (bc - hi.to(tl.float64)).to(tl.float32)
    hC = tl.sum(tl.where(rt == BT - 1, hi, 0.0), 0)
    lC = tl.sum(tl.where(rt == BT - 1, lo, 0.0), 0)
    ok = rt[:, None] >= rt[None, :]
    if RESETS:
        r = tl.load(r_ptr + bidx * T + t, mask=valid, other=0).to(tl.int32)
        seg = tl.cumsum(r, 0)
        last = tl.max(seg, 0)
        ok = ok & (seg[:, None] == seg[None, :])
        start = seg == 0
        end = (seg == last) & valid
        gL = tl.where(last == 0, tl.exp(hC), 0.0)
    else:
        start = rt >= 0
        end = valid
        gL = tl.exp(hC)
    diff = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    E = tl.where(ok, tl.exp(tl.where(ok, diff, 0.0)), 0.0)
    g0 = tl.where(start, tl.exp(hi), 0.0)
    gC = tl.where(end, tl.exp((hC - hi) + (lC - lo)), 0.0)
    return E, g0, gC, gL


@triton.jit
def _unit_lower_inverse(A, rt, BT: tl.constexpr):
    """(I + A)⁻¹ for A [BT, BT] strictly lower triangular, by forward substitution: with
    (I + A)⁻¹ = I + N, row i of N is −A_i − Σ_{j<i} A_ij N_j, the rows j < i already final."""
    N = -A
    for i in range(1, BT):
        sel = rt[:, None] == i
        row = tl.sum(tl.where(sel, N, 0.0), 0)
        row = row + tl.sum(row[:, None] * N, 0)
        N = tl.where(sel, row[None, :], N)
    return N + tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)


@triton.jit
def _head(n, LVH, H, T, D):
    """The batch index of folded head n and the offset of its values' rows in v [B, H, T, D]."""
    bidx = n // LVH
    return bidx, (bidx * H + n % H) * T * D


@triton.jit
def _program(T, H, LVH, D, BT: tl.constexpr, BD: tl.constexpr):
    """A parallel kernel's program (chunk c, folded head n) of its (NC, N) grid: c, n, the batch
    index and v's row offset (:func:`_head`), then :func:`_chunk`'s indices."""
    c = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    bidx, voff = _head(n, LVH, H, T, D)
    rt, t, valid, rd, m2, off, smask, soff = _chunk(n, c, T, D, BT, BD)
    return c, n, bidx, voff, rt, t, valid, rd, m2, off, smask, soff


@triton.jit
def _head_state(s_ptr, n, D, BD: tl.constexpr, PRESENT: tl.constexpr):
    """Folded head n's D×D matrix of an [N, D, D] buffer as a [BD, BD] tile, or zeros."""
    rd = tl.arange(0, BD)
    if PRESENT:
        return tl.load(s_ptr + n * D * D + rd[:, None] * D + rd[None, :], mask=(rd[:, None] < D) & (rd[None, :] < D),
                       other=0.0)
    return tl.zeros([BD, BD], dtype=tl.float32)


@triton.jit
def _store_head_state(s_ptr, n, D, BD: tl.constexpr, S):
    """S [BD, BD] as folded head n's D×D matrix of an [N, D, D] buffer."""
    rd = tl.arange(0, BD)
    tl.store(s_ptr + n * D * D + rd[:, None] * D + rd[None, :], S, mask=(rd[:, None] < D) & (rd[None, :] < D))


@triton.jit
def _dr_prepare_kernel(k_ptr, v_ptr, beta_ptr, g_ptr, r_ptr, m_ptr, w_ptr, u1_ptr, T, H, LVH, D, NC,
                       RESETS: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Per (chunk, folded head): M = (I + A)⁻¹, U' = M diag(β) V, W = M diag(β e^b) K̂."""
    c, n, bidx, voff, rt, t, valid, rd, m2, off, smask, soff = _program(T, H, LVH, D, BT, BD)
    k = tl.load(k_ptr + off, mask=m2, other=0.0)
    v = tl.load(v_ptr + voff + t.to(tl.int64)[:, None] * D + rd[None, :], mask=m2, other=0.0)
    beta = tl.load(beta_ptr + n * T + t, mask=valid, other=0.0)
    E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
    strict = rt[:, None] > rt[None, :]
    A = tl.where(strict, tl.dot(k, tl.trans(k), input_precision=PREC) * E * beta[:, None], 0.0)
    M = _unit_lower_inverse(A, rt, BT)
    tl.store(m_ptr + (n * NC + c) * BT * BT + rt[:, None] * BT + rt[None, :], M)
    tl.store(u1_ptr + off, tl.dot(M, v * beta[:, None], input_precision=PREC), mask=m2)
    tl.store(w_ptr + off, tl.dot(M, k * (beta * g0)[:, None], input_precision=PREC), mask=m2)


@triton.autotune(configs=_backend.sequential_configs(), key=["BT", "BD"])
@triton.jit
def _dr_states_kernel(k_ptr, g_ptr, r_ptr, w_ptr, u1_ptr, s0_ptr, hs_ptr, u_ptr, sf_ptr, T, H, LVH, D, NC,
                      HAS_INIT: tl.constexpr, RESETS: tl.constexpr, PREC: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr):
    """Sequential over one folded head's chunks: stores each chunk's start state, its values
    U = U' − W S₀, and S ← e^{b_C} S + (diag(e^{b_C − b}) K̂)ᵀ U; then the final state."""
    n = tl.program_id(0).to(tl.int64)
    bidx, _ = _head(n, LVH, H, T, D)
    S = _head_state(s0_ptr, n, D, BD, HAS_INIT)
    for c in range(NC):
        rt, t, valid, rd, m2, off, smask, soff = _chunk(n, c, T, D, BT, BD)
        tl.store(hs_ptr + (n * NC + c) * D * D + soff, S, mask=smask)
        u = tl.load(u1_ptr + off, mask=m2, other=0.0) - tl.dot(tl.load(w_ptr + off, mask=m2, other=0.0), S,
                                                               input_precision=PREC)
        tl.store(u_ptr + off, u, mask=m2)
        k = tl.load(k_ptr + off, mask=m2, other=0.0)
        E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
        S = gL * S + tl.dot(tl.trans(k * gC[:, None]), u, input_precision=PREC)
    _store_head_state(sf_ptr, n, D, BD, S)


@triton.jit
def _dr_output_kernel(q_ptr, k_ptr, g_ptr, r_ptr, hs_ptr, u_ptr, y_ptr, T, H, LVH, D, NC,
                      RESETS: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Per (chunk, folded head): y = diag(e^b) Q̂ S₀ + (Q̂K̂ᵀ ⊙ E) U."""
    c, n, bidx, voff, rt, t, valid, rd, m2, off, smask, soff = _program(T, H, LVH, D, BT, BD)
    q = tl.load(q_ptr + off, mask=m2, other=0.0)
    k = tl.load(k_ptr + off, mask=m2, other=0.0)
    u = tl.load(u_ptr + off, mask=m2, other=0.0)
    S = tl.load(hs_ptr + (n * NC + c) * D * D + soff, mask=smask, other=0.0)
    E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
    P = tl.dot(q, tl.trans(k), input_precision=PREC) * E
    y = tl.dot(q * g0[:, None], S, input_precision=PREC) + tl.dot(P, u, input_precision=PREC)
    tl.store(y_ptr + off, y, mask=m2)


@triton.autotune(configs=_backend.sequential_configs(), key=["BT", "BD"])
@triton.jit
def _dr_bwd_states_kernel(q_ptr, k_ptr, g_ptr, r_ptr, w_ptr, dy_ptr, dsf_ptr, dhs_ptr, du_ptr, ds0_ptr,
                          T, H, LVH, D, NC, HAS_DFINAL: tl.constexpr, RESETS: tl.constexpr,
                          PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Sequential over one folded head's chunks, last first, from dS (the gradient of the state at
    the chunk's end): stores it, dU = diag(e^{b_C − b}) K̂ dS + (Q̂K̂ᵀ ⊙ E)ᵀ dY, and passes on
    dS ← e^{b_C} dS + (diag(e^b) Q̂)ᵀ dY − Wᵀ dU; then the start state's gradient."""
    n = tl.program_id(0).to(tl.int64)
    bidx, _ = _head(n, LVH, H, T, D)
    dS = _head_state(dsf_ptr, n, D, BD, HAS_DFINAL)
    for i in range(NC):
        c = NC - 1 - i
        rt, t, valid, rd, m2, off, smask, soff = _chunk(n, c, T, D, BT, BD)
        tl.store(dhs_ptr + (n * NC + c) * D * D + soff, dS, mask=smask)
        q = tl.load(q_ptr + off, mask=m2, other=0.0)
        k = tl.load(k_ptr + off, mask=m2, other=0.0)
        w = tl.load(w_ptr + off, mask=m2, other=0.0)
        dy = tl.load(dy_ptr + off, mask=m2, other=0.0)
        E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
        P = tl.dot(q, tl.trans(k), input_precision=PREC) * E
        du = tl.dot(k * gC[:, None], dS, input_precision=PREC) + tl.dot(tl.trans(P), dy, input_precision=PREC)
        tl.store(du_ptr + off, du, mask=m2)
        dS = (gL * dS + tl.dot(tl.trans(q * g0[:, None]), dy, input_precision=PREC)
              - tl.dot(tl.trans(w), du, input_precision=PREC))
    _store_head_state(ds0_ptr, n, D, BD, dS)


@triton.jit
def _dr_bwd_output_kernel(q_ptr, k_ptr, g_ptr, r_ptr, u_ptr, hs_ptr, dhs_ptr, dy_ptr, dq_ptr, dk_ptr, db_ptr,
                          T, H, LVH, D, NC, RESETS: tl.constexpr, PREC: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr):
    """Per (chunk, folded head), the gradients through the output y = diag(e^b) Q̂ S₀ + (Q̂K̂ᵀ ⊙ E) U
    and the end state e^{b_C} S₀ + (diag(e^{b_C − b}) K̂)ᵀ U, from dY and the gradient dS of the end
    state: dq̂ whole, and k̂'s and b's shares (db: the gradient of each b_t, the log-decays summed
    from the chunk's start). :func:`_dr_bwd_solve_kernel` adds the rest: one kernel doing both
    held too many tiles at once and spilled registers."""
    c, n, bidx, voff, rt, t, valid, rd, m2, off, smask, soff = _program(T, H, LVH, D, BT, BD)
    q = tl.load(q_ptr + off, mask=m2, other=0.0)
    k = tl.load(k_ptr + off, mask=m2, other=0.0)
    u = tl.load(u_ptr + off, mask=m2, other=0.0)
    dy = tl.load(dy_ptr + off, mask=m2, other=0.0)
    S0 = tl.load(hs_ptr + (n * NC + c) * D * D + soff, mask=smask, other=0.0)
    dS = tl.load(dhs_ptr + (n * NC + c) * D * D + soff, mask=smask, other=0.0)
    E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
    P = tl.dot(dy, tl.trans(u), input_precision=PREC) * E  # the gradient of Q̂K̂ᵀ
    dq = tl.dot(dy, tl.trans(S0), input_precision=PREC) * g0[:, None] + tl.dot(P, k, input_precision=PREC)
    dk = tl.dot(tl.trans(P), q, input_precision=PREC) + tl.dot(u, tl.trans(dS), input_precision=PREC) * gC[:, None]
    G = P * tl.dot(q, tl.trans(k), input_precision=PREC)
    ec = tl.sum(tl.dot(k, dS, input_precision=PREC) * u, 1) * gC
    db = tl.sum(dy * tl.dot(q, S0, input_precision=PREC), 1) * g0 + tl.sum(G, 1) - tl.sum(G, 0) - ec
    db += tl.where(rt == BT - 1, gL * tl.sum(tl.sum(dS * S0, 1), 0) + tl.sum(ec, 0), 0.0)  # b_C's
    tl.store(dq_ptr + off, dq, mask=m2)
    tl.store(dk_ptr + off, dk, mask=m2)
    tl.store(db_ptr + n * NC * BT + c * BT + rt, db)


@triton.jit
def _dr_bwd_solve_kernel(k_ptr, v_ptr, beta_ptr, g_ptr, r_ptr, m_ptr, w_ptr, u1_ptr, hs_ptr, du_ptr, db_ptr,
                         dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, T, H, LVH, D, NC, RESETS: tl.constexpr,
                         PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Per (chunk, folded head), the gradients through U = U' − W S₀, U' = M diag(β) V,
    W = M diag(β e^b) K̂, M = (I + A)⁻¹: dY = Mᵀ dX and dA = −Mᵀ (dU' (β V)ᵀ + dW (β e^b K̂)ᵀ) Mᵀ
    = −(dY₁ U'ᵀ + dY₂ Wᵀ), into k̂ (added to the output's share), v (this level's share), β and b;
    then dg_j = Σ_{t ≥ j} db_t (the log-decays enter through their sums b alone)."""
    c, n, bidx, voff, rt, t, valid, rd, m2, off, smask, soff = _program(T, H, LVH, D, BT, BD)
    k = tl.load(k_ptr + off, mask=m2, other=0.0)
    v = tl.load(v_ptr + voff + t.to(tl.int64)[:, None] * D + rd[None, :], mask=m2, other=0.0)
    beta = tl.load(beta_ptr + n * T + t, mask=valid, other=0.0)
    du = tl.load(du_ptr + off, mask=m2, other=0.0)
    S0 = tl.load(hs_ptr + (n * NC + c) * D * D + soff, mask=smask, other=0.0)
    M = tl.load(m_ptr + (n * NC + c) * BT * BT + rt[:, None] * BT + rt[None, :])
    E, g0, gC, gL = _decays(g_ptr, r_ptr, n, bidx, t, rt, valid, T, BT, RESETS)
    strict = rt[:, None] > rt[None, :]
    dY1 = tl.dot(tl.trans(M), du, input_precision=PREC)
    dY2 = -tl.dot(tl.trans(M), tl.dot(du, tl.trans(S0), input_precision=PREC), input_precision=PREC)
    dA = -(tl.dot(dY1, tl.trans(tl.load(u1_ptr + off, mask=m2, other=0.0)), input_precision=PREC)
           + tl.dot(dY2, tl.trans(tl.load(w_ptr + off, mask=m2, other=0.0)), input_precision=PREC))
    KE = tl.where(strict, tl.dot(k, tl.trans(k), input_precision=PREC) * E, 0.0)
    dA = tl.where(strict, dA, 0.0)
    bg = beta * g0
    k2 = tl.sum(dY2 * k, 1)
    dbeta = tl.sum(dA * KE, 1) + tl.sum(dY1 * v, 1) + k2 * g0
    dKK = dA * E * beta[:, None]
    dk = (tl.load(dk_ptr + off, mask=m2, other=0.0) + tl.dot(dKK, k, input_precision=PREC)
          + tl.dot(tl.trans(dKK), k, input_precision=PREC) + dY2 * bg[:, None])
    GA = dA * KE * beta[:, None]
    db = tl.load(db_ptr + n * NC * BT + c * BT + rt) + tl.sum(GA, 1) - tl.sum(GA, 0) + k2 * bg
    tl.store(dk_ptr + off, dk, mask=m2)
    tl.store(dv_ptr + off, dY1 * beta[:, None], mask=m2)
    tl.store(dbeta_ptr + n * T + t, dbeta, mask=valid)
    tl.store(dg_ptr + n * T + t, tl.cumsum(db, 0, reverse=True), mask=valid)


@triton.jit
def _dr_decode_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, r_ptr, s0_ptr, y_ptr, sf_ptr, T, H, LVH, D,
                      HAS_INIT: tl.constexpr, RESETS: tl.constexpr, BD: tl.constexpr):
    """One folded head, one position at a time: S ← γ S (zeroed first at a reset),
    S += β k̂ (v − Sᵀ k̂)ᵀ, y = Sᵀ q̂."""
    n = tl.program_id(0).to(tl.int64)
    bidx, voff = _head(n, LVH, H, T, D)
    rd = tl.arange(0, BD)
    dmask = rd < D
    S = _head_state(s0_ptr, n, D, BD, HAS_INIT)
    for t in range(T):
        if RESETS:
            S = tl.where(tl.load(r_ptr + bidx * T + t) != 0, 0.0, S)
        q = tl.load(q_ptr + n * T * D + t * D + rd, mask=dmask, other=0.0)
        k = tl.load(k_ptr + n * T * D + t * D + rd, mask=dmask, other=0.0)
        v = tl.load(v_ptr + voff + t * D + rd, mask=dmask, other=0.0)
        S = tl.exp(tl.load(g_ptr + n * T + t)) * S
        recalled = tl.sum(k[:, None] * S, 0)
        S += (tl.load(beta_ptr + n * T + t) * k)[:, None] * (v - recalled)[None, :]
        tl.store(y_ptr + n * T * D + t * D + rd, tl.sum(q[:, None] * S, 0), mask=dmask)
    _store_head_state(sf_ptr, n, D, BD, S)


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


class _TritonDeltaRule(torch.autograd.Function):
    """(fq, fk [N, T, D], v [B, H, T, D], beta, g [N, T] fp32, S0 [N, D, D] or None, resets [B, T]
    int32 or None, Lv, H, precision, chunk) → (y [N, T, D], S [N, D, D]), every tensor fp32."""

    @staticmethod
    def forward(ctx, fq, fk, v, beta, g, S0, resets, Lv, H, prec, BT):
        N, T, D = fq.shape
        NC, BD = triton.cdiv(T, BT), _block_d(D)
        dev = fq.device
        shape = dict(T=T, H=H, LVH=Lv * H, D=D, NC=NC)
        flags = dict(RESETS=resets is not None, PREC=prec, BT=BT, BD=BD)
        r = resets if resets is not None else g  # a pointer the kernels do not read
        M = _backend.empty(N, NC, BT, BT, dtype=torch.float32, device=dev)
        W, U1, U, y = (_backend.empty(N, T, D, dtype=torch.float32, device=dev) for _ in range(4))
        hs = _backend.empty(N, NC, D, D, dtype=torch.float32, device=dev)
        sf = _backend.empty(N, D, D, dtype=torch.float32, device=dev)
        _dr_prepare_kernel[(NC, N)](fk, v, beta, g, r, M, W, U1, **shape, **flags, num_warps=_PARALLEL_WARPS)
        _dr_states_kernel[(N,)](fk, g, r, W, U1, S0 if S0 is not None else sf, hs, U, sf, **shape,
                                HAS_INIT=S0 is not None, **flags)
        _dr_output_kernel[(NC, N)](fq, fk, g, r, hs, U, y, **shape, **flags, num_warps=_PARALLEL_WARPS)
        ctx.save_for_backward(fq, fk, v, beta, g, resets, M, W, U1, U, hs)
        ctx.shape, ctx.flags, ctx.has_init = shape, flags, S0 is not None
        ctx.set_materialize_grads(False)
        return y, sf

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, dy, dsf):
        fq, fk, v, beta, g, resets, M, W, U1, U, hs = ctx.saved_tensors
        shape, flags = ctx.shape, ctx.flags
        N, T, D = fq.shape
        NC, dev = shape["NC"], fq.device
        r = resets if resets is not None else g
        dy = torch.zeros_like(fq) if dy is None else dy.float().contiguous()
        dhs = _backend.empty(N, NC, D, D, dtype=torch.float32, device=dev)
        du = _backend.empty(N, T, D, dtype=torch.float32, device=dev)
        ds0 = _backend.empty(N, D, D, dtype=torch.float32, device=dev)
        _dr_bwd_states_kernel[(N,)](fq, fk, g, r, W, dy, dsf.float().contiguous() if dsf is not None else ds0,
                                    dhs, du, ds0, **shape, HAS_DFINAL=dsf is not None, **flags)
        dq, dk, dv = (_backend.empty(N, T, D, dtype=torch.float32, device=dev) for _ in range(3))
        dbeta, dg = (_backend.empty(N, T, dtype=torch.float32, device=dev) for _ in range(2))
        db = _backend.empty(N, NC * ctx.flags["BT"], dtype=torch.float32, device=dev)
        _dr_bwd_output_kernel[(NC, N)](fq, fk, g, r, U, hs, dhs, dy, dq, dk, db, **shape, **flags,
                                       num_warps=_PARALLEL_WARPS)
        _dr_bwd_solve_kernel[(NC, N)](fk, v, beta, g, r, M, W, U1, hs, du, db, dk, dv, dbeta, dg, **shape, **flags,
                                      num_warps=_PARALLEL_WARPS)
        B, H = v.shape[:2]
        dv = dv.view(B, -1, H, T, D)
        dv = dv[:, 0] if dv.shape[1] == 1 else dv.sum(1)  # the levels share v
        return dq, dk, dv, dbeta, dg, ds0 if ctx.has_init else None, None, None, None, None, None


def delta_rule_triton(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None, chunk=CHUNK):
    """Triton path: the decode kernel for T ≤ 16 without autograd, else the chunked Function.
    Returns (o [B, T, H, D] in q's dtype, S [B, Lv, H, D, D] fp32)."""
    check_inputs(q, k, v, beta, omegas)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton delta rule takes fp32/fp16/bf16 inputs, got {q.dtype}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two ≥ 16 (tl.dot's smallest tile), got {chunk}")
    B, T, H, D = q.shape
    Lv = len(omegas)
    N = B * Lv * H
    # bf16 (the training dtype) dots in tf32; fp16's in IEEE fp32, since tf32 keeps fp16's 10 mantissa
    # bits only by truncation and would cost fp16 8x its reference's error
    prec = "tf32" if q.dtype == torch.bfloat16 else "ieee"

    def folded(x):  # [B, Lv, T, H, ...] → [N, T, ...]
        return x.transpose(2, 3).reshape(N, T, *x.shape[4:]).contiguous()

    fq, fk = folded(unit_features(q.float(), omegas)), folded(unit_features(k.float(), omegas))
    vh = v.float().transpose(1, 2).contiguous()  # [B, H, T, D]
    bt = folded(beta.float().permute(0, 2, 1, 3)[..., None])[..., 0]
    gam = _backend.level_decays(decay, B, T, Lv, H, torch.float32, q.device)
    g = folded(torch.log(gam).expand(B, T, Lv, H).permute(0, 2, 1, 3)[..., None])[..., 0]
    S0 = None if state is None else state.float().reshape(N, D, D).contiguous()
    r = None if resets is None else resets.to(torch.int32).contiguous()
    grads = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, level_weights, beta, decay, state))
    if T <= _DECODE_MAX_T and not grads:
        y = _backend.empty(N, T, D, dtype=torch.float32, device=q.device)
        S = _backend.empty(N, D, D, dtype=torch.float32, device=q.device)
        _dr_decode_kernel[(N,)](fq, fk, vh, bt, g, r if r is not None else g, S0 if S0 is not None else S, y, S,
                                T, H, Lv * H, D, HAS_INIT=S0 is not None, RESETS=r is not None, BD=_block_d(D),
                                num_warps=4)
    else:
        y, S = _TritonDeltaRule.apply(fq, fk, vh, bt, g, S0, r, Lv, H, prec, chunk)
    o = torch.einsum("l,blhtd->bthd", level_weights.float(), y.view(B, Lv, H, T, D))
    return o.to(q.dtype).contiguous(), S.view(B, Lv, H, D, D)
