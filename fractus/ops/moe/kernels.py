"""The sparse experts' Triton kernels and their autograd Functions.

Routing is built on the device (:class:`Route`: no host sync). Low-rank experts run in one fused
forward kernel per (expert, row-block) tile, the hidden activation on chip; the backward recomputes
it, in three kernels (per-row gradients, then the feed-forward and the model-side factors' weight
gradients per expert). Dense experts run as grouped GEMMs over the same tiles, the hidden
pre-activation kept for the backward.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend
from fractus.ops.moe.pytorch import moe_torch
from fractus.ops.moe.reference import DENSE_KEYS, LOWRANK_KEYS, is_lowrank

__all__ = ["GPU_BLOCK_M", "Route", "block_m", "moe_triton"]

GPU_BLOCK_M = 64  # rows per routing tile on the GPU (tests run it in the interpreter too)


def block_m() -> int:
    """Rows per routing tile (fixed: the tile list is built with it)."""
    return 16 if _backend.interpreting() else GPU_BLOCK_M


def _autotune(names: tuple[str, ...], gpu: tuple[tuple[int, ...], ...], key: list[str]):
    """``triton.autotune`` over ``gpu``'s configs, rows of (*block sizes, num_warps, num_stages);
    a single small config in the interpreter. The GPU's configs stay on the kernel as
    ``gpu_configs`` (tests run each of them in the interpreter). The fused kernels hold several
    [BM, R] fp32 tiles: compiled ahead of time for sm_90 (python -m fractus.bench aot), their
    8-warp configs do not spill registers in bf16 (r = 64) and a 4-warp one does, so they have none."""
    gpu_configs = [triton.Config(dict(zip(names, blocks)), num_warps=w, num_stages=s) for *blocks, w, s in gpu]
    small = [triton.Config(dict(zip(names, (32, 16))), num_warps=1)]

    def wrap(fn):
        tuner = triton.autotune(configs=small if _backend.interpreting() else gpu_configs, key=key)(fn)
        tuner.gpu_configs = gpu_configs
        return tuner
    return wrap


_FUSED_CFG = ((64, 64, 8, 3), (128, 64, 8, 3), (64, 32, 8, 3))
_GMM_CFG = ((64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3))


@triton.jit
def _gelu(z):
    return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_grad(z):
    return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327


@triton.jit
def _tile(tile_e_ptr, tile_lo_ptr, tile_hi_ptr, stok_ptr, d, F, r, BM: tl.constexpr, R: tl.constexpr,
          BD: tl.constexpr, BF: tl.constexpr):
    """This program's routing tile: expert e, its sorted rows [BM] and their mask, their tokens,
    the number of d and d_ff blocks (0 for an empty tile), and the rank index ri [R] and mask."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    lo = tl.load(tile_lo_ptr + t)
    hi = tl.load(tile_hi_ptr + t)
    rows = (lo + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < hi
    tok = tl.load(stok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ri = tl.arange(0, R)
    return (e, rows, rmask, tok, tl.where(hi > lo, tl.cdiv(d, BD), 0), tl.where(hi > lo, tl.cdiv(F, BF), 0),
            ri, ri < r)


@_autotune(("BD", "BF"), _FUSED_CFG, key=["d", "F", "R"])
@triton.jit
def _lr_fwd_kernel(x_ptr, stok_ptr, slot_ptr, rw_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                   V1, U1, b1, s1, V2, U2, b2, s2, y_ptr, a1_ptr, a2_ptr, d, F, r,
                   SAVE: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                   BD: tl.constexpr, BF: tl.constexpr):
    """One (expert, row-block) tile of the low-rank forward; rows are sorted (token, slot) pairs.

    a1 = m V1, a2 = gelu(s1 a1 U1ᵀ + b1) V2 (r wide, on chip, d_ff streamed in BF blocks),
    y_slot = rw · (s2 a2 U2ᵀ + b2) written at the pair's slot; a1, a2 saved (fp32) for backward.
    """
    CDT = x_ptr.dtype.element_ty
    e, rows, rmask, tok, nd, nf, ri, rm = _tile(tile_e_ptr, tile_lo_ptr, tile_hi_ptr, stok_ptr, d, F, r,
                                                BM, R, BD, BF)
    a1 = tl.zeros([BM, R], dtype=tl.float32)
    for i in range(0, nd):
        cd = i * BD + tl.arange(0, BD)
        dm = cd < d
        xm = tl.load(x_ptr + tok[:, None] * d + cd[None, :], mask=rmask[:, None] & dm[None, :], other=0.0)
        v1 = tl.load(V1 + e * d * r + cd[:, None] * r + ri[None, :], mask=dm[:, None] & rm[None, :], other=0.0)
        a1 = tl.dot(xm.to(CDT), v1.to(CDT), a1, input_precision=PREC)
    h1 = (a1 * tl.load(s1 + e).to(tl.float32)).to(CDT)
    a2 = tl.zeros([BM, R], dtype=tl.float32)
    for j in range(0, nf):
        cf = j * BF + tl.arange(0, BF)
        fm = cf < F
        u1t = tl.load(U1 + e * F * r + cf[None, :] * r + ri[:, None], mask=rm[:, None] & fm[None, :], other=0.0)
        bb = tl.load(b1 + e * F + cf, mask=fm, other=0.0).to(tl.float32)
        z = tl.dot(h1, u1t.to(CDT), input_precision=PREC) + bb[None, :]
        v2 = tl.load(V2 + e * F * r + cf[:, None] * r + ri[None, :], mask=fm[:, None] & rm[None, :], other=0.0)
        a2 = tl.dot(_gelu(z).to(CDT), v2.to(CDT), a2, input_precision=PREC)
    if SAVE:
        smask = rmask[:, None] & rm[None, :]
        tl.store(a1_ptr + rows[:, None] * r + ri[None, :], a1, mask=smask)
        tl.store(a2_ptr + rows[:, None] * r + ri[None, :], a2, mask=smask)
    s2v = tl.load(s2 + e).to(tl.float32)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    a2c = a2.to(CDT)
    for i in range(0, nd):
        cd = i * BD + tl.arange(0, BD)
        dm = cd < d
        u2t = tl.load(U2 + e * d * r + cd[None, :] * r + ri[:, None], mask=rm[:, None] & dm[None, :], other=0.0)
        bb = tl.load(b2 + e * d + cd, mask=dm, other=0.0).to(tl.float32)
        f = tl.dot(a2c, u2t.to(CDT), input_precision=PREC) * s2v + bb[None, :]
        tl.store(y_ptr + slot[:, None] * d + cd[None, :], (f * rw[:, None]).to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dm[None, :])


@_autotune(("BD", "BF"), _FUSED_CFG, key=["d", "F", "R"])
@triton.jit
def _lr_bwd_rows_kernel(dy_ptr, stok_ptr, slot_ptr, rw_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                        V1, U1, b1, s1, V2, U2, b2, s2, a1_ptr, a2_ptr,
                        dxs_ptr, da1_ptr, da2_ptr, drw_ptr, ds1_ptr, ds2_ptr, d, F, r,
                        PREC: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                        BD: tl.constexpr, BF: tl.constexpr):
    """Row part of the low-rank backward for one tile; the hidden activation is recomputed.

    Per row: drw = <dy, f>, da2 = s2 rw dy U2, dz = (da2 V2ᵀ)·gelu'(z), dh1 = dz U1, da1 = s1 dh1,
    dm = da1 V1ᵀ (written at the slot); da1, da2 and the per-row s1/s2 terms are saved for the
    weight-gradient kernels and the per-expert sums.
    """
    CDT = dy_ptr.dtype.element_ty
    e, rows, rmask, tok, nd, nf, ri, rm = _tile(tile_e_ptr, tile_lo_ptr, tile_hi_ptr, stok_ptr, d, F, r,
                                                BM, R, BD, BF)
    rmask2 = rmask[:, None] & rm[None, :]
    a1 = tl.load(a1_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0)
    a2 = tl.load(a2_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0)
    dyu2 = tl.zeros([BM, R], dtype=tl.float32)
    dyb2 = tl.zeros([BM], dtype=tl.float32)
    for i in range(0, nd):
        cd = i * BD + tl.arange(0, BD)
        dm = cd < d
        dyb = tl.load(dy_ptr + tok[:, None] * d + cd[None, :], mask=rmask[:, None] & dm[None, :], other=0.0)
        u2 = tl.load(U2 + e * d * r + cd[:, None] * r + ri[None, :], mask=dm[:, None] & rm[None, :], other=0.0)
        dyu2 = tl.dot(dyb.to(CDT), u2.to(CDT), dyu2, input_precision=PREC)
        bb = tl.load(b2 + e * d + cd, mask=dm, other=0.0).to(tl.float32)
        dyb2 += tl.sum(dyb.to(tl.float32) * bb[None, :], axis=1)
    s1v = tl.load(s1 + e).to(tl.float32)
    s2v = tl.load(s2 + e).to(tl.float32)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    t2 = tl.sum(dyu2 * a2, axis=1)
    da2 = dyu2 * (s2v * rw)[:, None]
    h1 = (a1 * s1v).to(CDT)
    da2c = da2.to(CDT)
    dh1 = tl.zeros([BM, R], dtype=tl.float32)
    for j in range(0, nf):
        cf = j * BF + tl.arange(0, BF)
        fm = cf < F
        wmask = fm[:, None] & rm[None, :]
        u1 = tl.load(U1 + e * F * r + cf[:, None] * r + ri[None, :], mask=wmask, other=0.0).to(CDT)
        v2 = tl.load(V2 + e * F * r + cf[:, None] * r + ri[None, :], mask=wmask, other=0.0).to(CDT)
        bb = tl.load(b1 + e * F + cf, mask=fm, other=0.0).to(tl.float32)
        z = tl.dot(h1, tl.trans(u1), input_precision=PREC) + bb[None, :]
        dz = tl.dot(da2c, tl.trans(v2), input_precision=PREC) * _gelu_grad(z)
        dh1 = tl.dot(dz.to(CDT), u1, dh1, input_precision=PREC)
    da1 = dh1 * s1v
    tl.store(da1_ptr + rows[:, None] * r + ri[None, :], da1, mask=rmask2)
    tl.store(da2_ptr + rows[:, None] * r + ri[None, :], da2, mask=rmask2)
    tl.store(drw_ptr + rows, s2v * t2 + dyb2, mask=rmask)
    tl.store(ds1_ptr + rows, tl.sum(dh1 * a1, axis=1), mask=rmask)
    tl.store(ds2_ptr + rows, rw * t2, mask=rmask)
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    da1c = da1.to(CDT)
    for i in range(0, nd):
        cd = i * BD + tl.arange(0, BD)
        dm = cd < d
        v1 = tl.load(V1 + e * d * r + cd[:, None] * r + ri[None, :], mask=dm[:, None] & rm[None, :], other=0.0)
        dxm = tl.dot(da1c, tl.trans(v1.to(CDT)), input_precision=PREC)
        tl.store(dxs_ptr + slot[:, None] * d + cd[None, :], dxm.to(dxs_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dm[None, :])


@_autotune(("BF",), ((32, 8, 3), (64, 8, 3), (32, 8, 2)), key=["F", "R", "CDT"])  # fp32 masters: CDT
@triton.jit
def _lr_bwd_ff_kernel(offs_ptr, a1_ptr, da2_ptr, U1, b1, s1, V2, dU1, dV2, db1, F, r,
                      CDT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                      BF: tl.constexpr):
    """Weight gradients on the d_ff side for one (expert, BF block), fp32, looping over the
    expert's rows: z recomputed from a1; dV2 = gelu(z)ᵀ da2, dU1 = dzᵀ (s1 a1), db1 = Σ dz.
    CDT: the tokens' dtype, in which the dots run (the weights may be fp32 masters)."""
    e = tl.program_id(0).to(tl.int64)
    cf = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = cf < F
    ri = tl.arange(0, R)
    rm = ri < r
    wmask = fm[:, None] & rm[None, :]
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    u1 = tl.load(U1 + e * F * r + cf[:, None] * r + ri[None, :], mask=wmask, other=0.0).to(CDT)
    v2 = tl.load(V2 + e * F * r + cf[:, None] * r + ri[None, :], mask=wmask, other=0.0).to(CDT)
    bb = tl.load(b1 + e * F + cf, mask=fm, other=0.0).to(tl.float32)
    s1v = tl.load(s1 + e).to(tl.float32)
    du1 = tl.zeros([BF, R], dtype=tl.float32)
    dv2 = tl.zeros([BF, R], dtype=tl.float32)
    db = tl.zeros([BF], dtype=tl.float32)
    for i in range(0, tl.cdiv(hi - lo, BM)):
        rows = (lo + i * BM + tl.arange(0, BM)).to(tl.int64)
        rmask2 = (rows < hi)[:, None] & rm[None, :]
        h1 = (tl.load(a1_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0) * s1v).to(CDT)
        da2 = tl.load(da2_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0).to(CDT)
        z = tl.dot(h1, tl.trans(u1), input_precision=PREC) + bb[None, :]
        dz = tl.dot(da2, tl.trans(v2), input_precision=PREC) * _gelu_grad(z)
        dv2 = tl.dot(tl.trans(_gelu(z).to(CDT)), da2, dv2, input_precision=PREC)
        du1 = tl.dot(tl.trans(dz.to(CDT)), h1, du1, input_precision=PREC)
        db += tl.sum(dz, axis=0)
    tl.store(dU1 + e * F * r + cf[:, None] * r + ri[None, :], du1, mask=wmask)
    tl.store(dV2 + e * F * r + cf[:, None] * r + ri[None, :], dv2, mask=wmask)
    tl.store(db1 + e * F + cf, db, mask=fm)


@_autotune(("BD",), ((64, 8, 3), (128, 8, 3), (32, 4, 3)), key=["d", "R"])
@triton.jit
def _lr_bwd_model_kernel(offs_ptr, x_ptr, dy_ptr, stok_ptr, rw_ptr, da1_ptr, a2_ptr, s2,
                         dV1, dU2, db2, d, r,
                         PREC: tl.constexpr, BM: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """Weight gradients on the d_model side for one (expert, BD block), fp32:
    dV1 = mᵀ da1, dU2 = s2 (rw dy)ᵀ a2, db2 = Σ rw dy over the expert's rows."""
    CDT = x_ptr.dtype.element_ty
    e = tl.program_id(0).to(tl.int64)
    cd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = cd < d
    ri = tl.arange(0, R)
    rm = ri < r
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    dv1 = tl.zeros([BD, R], dtype=tl.float32)
    du2 = tl.zeros([BD, R], dtype=tl.float32)
    db = tl.zeros([BD], dtype=tl.float32)
    for i in range(0, tl.cdiv(hi - lo, BM)):
        rows = (lo + i * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < hi
        rmask2 = rmask[:, None] & rm[None, :]
        xmask = rmask[:, None] & dm[None, :]
        tok = tl.load(stok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        xm = tl.load(x_ptr + tok[:, None] * d + cd[None, :], mask=xmask, other=0.0).to(CDT)
        rwdy = tl.load(dy_ptr + tok[:, None] * d + cd[None, :], mask=xmask, other=0.0).to(tl.float32) * rw[:, None]
        da1 = tl.load(da1_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0).to(CDT)
        a2 = tl.load(a2_ptr + rows[:, None] * r + ri[None, :], mask=rmask2, other=0.0).to(CDT)
        dv1 = tl.dot(tl.trans(xm), da1, dv1, input_precision=PREC)
        du2 = tl.dot(tl.trans(rwdy.to(CDT)), a2, du2, input_precision=PREC)
        db += tl.sum(rwdy, axis=0)
    wmask = dm[:, None] & rm[None, :]
    tl.store(dV1 + e * d * r + cd[:, None] * r + ri[None, :], dv1, mask=wmask)
    tl.store(dU2 + e * d * r + cd[:, None] * r + ri[None, :], du2 * tl.load(s2 + e).to(tl.float32), mask=wmask)
    tl.store(db2 + e * d + cd, db, mask=dm)


@_autotune(("BK", "BN"), _GMM_CFG, key=["KD", "ND", "sw_k", "sw_n"])  # strides: W or Wᵀ
@triton.jit
def _gmm_kernel(a_ptr, a_idx_ptr, w_ptr, bias_ptr, z_ptr, out_ptr, out_idx_ptr,
                tile_e_ptr, tile_lo_ptr, tile_hi_ptr, KD, ND, sw_e, sw_k, sw_n,
                A_IDX: tl.constexpr, A_GELU: tl.constexpr, BIAS: tl.constexpr, DGELU: tl.constexpr,
                OUT_IDX: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr):
    """Grouped GEMM over routing tiles: out[o(p)] = epi(act(A[a(p)]) W_e) for the sorted rows p
    of a tile of expert e. A [*, KD]; W_e addressed by strides (so Wᵀ is free); act = gelu
    if A_GELU; epi adds bias[e] (BIAS) and multiplies by gelu'(Z[p]) (DGELU, Z [rows, ND])."""
    CDT = a_ptr.dtype.element_ty
    t = tl.program_id(0)
    cn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = cn < ND
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    lo = tl.load(tile_lo_ptr + t)
    hi = tl.load(tile_hi_ptr + t)
    rows = (lo + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < hi
    if A_IDX:
        arow = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        arow = rows
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i in range(0, tl.where(hi > lo, tl.cdiv(KD, BK), 0)):
        ck = i * BK + tl.arange(0, BK)
        km = ck < KD
        a = tl.load(a_ptr + arow[:, None] * KD + ck[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        if A_GELU:
            a = _gelu(a.to(tl.float32))
        wt = tl.load(w_ptr + e * sw_e + ck[:, None] * sw_k + cn[None, :] * sw_n,
                     mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a.to(CDT), wt.to(CDT), acc, input_precision=PREC)
    omask = rmask[:, None] & nm[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + e * ND + cn, mask=nm, other=0.0).to(tl.float32)[None, :]
    if DGELU:
        acc *= _gelu_grad(tl.load(z_ptr + rows[:, None] * ND + cn[None, :], mask=omask, other=0.0).to(tl.float32))
    if OUT_IDX:
        orow = tl.load(out_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        orow = rows
    tl.store(out_ptr + orow[:, None] * ND + cn[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@_autotune(("BI", "BJ"), _GMM_CFG, key=["I", "J"])
@triton.jit
def _gmm_wgrad_kernel(offs_ptr, a_ptr, a_idx_ptr, b_ptr, b_idx_ptr, dw_ptr, db_ptr, I, J,
                      A_IDX: tl.constexpr, A_GELU: tl.constexpr, B_IDX: tl.constexpr,
                      BIAS: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr,
                      BI: tl.constexpr, BJ: tl.constexpr):
    """Grouped weight gradient, fp32: dW[e] = Σ_p act(A[a(p)])ᵀ B[b(p)] over the sorted rows p of
    expert e (A [*, I], B [*, J], dW [E, I, J]); with BIAS also db[e] = Σ_p B[b(p)]."""
    CDT = a_ptr.dtype.element_ty
    e = tl.program_id(0).to(tl.int64)
    pi = tl.program_id(1)
    ci = pi * BI + tl.arange(0, BI)
    cj = tl.program_id(2) * BJ + tl.arange(0, BJ)
    im = ci < I
    jm = cj < J
    lo = tl.load(offs_ptr + e)
    hi = tl.load(offs_ptr + e + 1)
    acc = tl.zeros([BI, BJ], dtype=tl.float32)
    bacc = tl.zeros([BJ], dtype=tl.float32)
    for i in range(0, tl.cdiv(hi - lo, BM)):
        rows = (lo + i * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < hi
        if A_IDX:
            arow = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = rows
        if B_IDX:
            brow = tl.load(b_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            brow = rows
        a = tl.load(a_ptr + arow[:, None] * I + ci[None, :], mask=rmask[:, None] & im[None, :], other=0.0)
        if A_GELU:
            a = _gelu(a.to(tl.float32))
        b = tl.load(b_ptr + brow[:, None] * J + cj[None, :], mask=rmask[:, None] & jm[None, :], other=0.0)
        acc = tl.dot(tl.trans(a.to(CDT)), b.to(CDT), acc, input_precision=PREC)
        if BIAS:
            bacc += tl.sum(b.to(tl.float32), axis=0)
    tl.store(dw_ptr + e * I * J + ci[:, None] * J + cj[None, :], acc, mask=im[:, None] & jm[None, :])
    if BIAS:
        tl.store(db_ptr + e * J + cj, bacc, mask=cj < tl.where(pi == 0, J, 0))


class Route:
    """Device-side routing bookkeeping for idx [N, K] over E experts (no host sync).

    order [NK]: flat (token, slot) ids sorted by expert; stok = order // K; sexp: their
    experts; offs [E + 1]: row offsets per expert; tiles: (expert, lo, hi) for at most
    ceil(NK / BM) + E row blocks, unused ones empty (lo == hi == 0). The offsets and tiles are
    int32 and a tile's rows lo + [0, BM) too: NK + BM must stay below 2³¹ (ValueError otherwise,
    from the shape alone).
    """

    def __init__(self, idx: torch.Tensor, E: int, BM: int):
        N, K = idx.shape
        if N * K + BM >= 2 ** 31:
            raise ValueError(f"the Triton MoE routes fewer than 2³¹ − {BM} (token, slot) pairs per call (its "
                             f"row offsets are int32), got {N} tokens × {K} slots: split the tokens")
        flat = idx.reshape(-1)
        self.sexp, order = torch.sort(flat, stable=True)
        self.order = order
        self.stok = order // K
        counts = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        ends = torch.cumsum(counts, 0)
        self.offs = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        ntile = (counts + BM - 1) // BM
        tcum = torch.cumsum(ntile, 0)
        T = triton.cdiv(N * K, BM) + E
        t = torch.arange(T, device=idx.device)
        te = torch.searchsorted(tcum, t, right=True)
        valid = te < E
        te = te.clamp(max=E - 1)
        lo = torch.where(valid, ends[te] - counts[te] + (t - (tcum[te] - ntile[te])) * BM, 0)
        hi = torch.where(valid, torch.minimum(lo + BM, ends[te]), 0)
        self.tile_e, self.tile_lo, self.tile_hi = te.to(torch.int32), lo.to(torch.int32), hi.to(torch.int32)
        self.T = T


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _sum_slots(slots: torch.Tensor, N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """[N·K, d] per-slot rows → [N, d] summed over the K slots in fp32."""
    s = slots.view(N, K, -1)
    return (s[:, 0] if K == 1 else s.float().sum(1)).to(dtype)


class _LowRankMoE(torch.autograd.Function):
    """Fused low-rank MoE on routing tiles; backward recomputes the hidden activation."""

    @staticmethod
    def forward(ctx, x, w, idx, V1, U1, b1, s1, V2, U2, b2, s2, save):
        N, d = x.shape
        K = idx.shape[1]
        E, F, r = U1.shape
        BM, R = block_m(), _rank_block(r)
        rt = Route(idx, E, BM)
        rw = w.reshape(-1)[rt.order].float()
        dev = x.device
        ys = _backend.empty(N * K, d, dtype=x.dtype, device=dev)
        a1 = _backend.empty(N * K, r, dtype=torch.float32, device=dev) if save else ys
        a2 = _backend.empty(N * K, r, dtype=torch.float32, device=dev) if save else ys
        _lr_fwd_kernel[(rt.T,)](x, rt.stok, rt.order, rw, rt.tile_e, rt.tile_lo, rt.tile_hi,
                                V1, U1, b1, s1, V2, U2, b2, s2, ys, a1, a2, d, F, r,
                                SAVE=save, PREC=_backend.dot_precision(x), BM=BM, R=R)
        if save:
            ctx.rt, ctx.K = rt, K
            ctx.save_for_backward(x, w, rw, a1, a2, V1, U1, b1, s1, V2, U2, b2, s2)
        return _sum_slots(ys, N, K, x.dtype)

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, dy):
        x, w, rw, a1, a2, V1, U1, b1, s1, V2, U2, b2, s2 = ctx.saved_tensors
        rt, K = ctx.rt, ctx.K
        N, d = x.shape
        E, F, r = U1.shape
        BM, R, prec, dev = block_m(), _rank_block(r), _backend.dot_precision(x), x.device
        dy = dy.contiguous().to(x.dtype)
        f32 = dict(dtype=torch.float32, device=dev)
        dxs = _backend.empty(N * K, d, dtype=x.dtype, device=dev)
        da1, da2 = _backend.empty(N * K, r, **f32), _backend.empty(N * K, r, **f32)
        drw, ds1r, ds2r = (_backend.empty(N * K, **f32) for _ in range(3))
        _lr_bwd_rows_kernel[(rt.T,)](dy, rt.stok, rt.order, rw, rt.tile_e, rt.tile_lo, rt.tile_hi,
                                     V1, U1, b1, s1, V2, U2, b2, s2, a1, a2,
                                     dxs, da1, da2, drw, ds1r, ds2r, d, F, r, PREC=prec, BM=BM, R=R)
        dU1, dV2 = _backend.empty(E, F, r, **f32), _backend.empty(E, F, r, **f32)
        db1 = _backend.empty(E, F, **f32)
        _lr_bwd_ff_kernel[lambda m: (E, triton.cdiv(F, m["BF"]))](
            rt.offs, a1, da2, U1, b1, s1, V2, dU1, dV2, db1, F, r, CDT=_TL_DTYPES[x.dtype], PREC=prec, BM=BM, R=R)
        dV1, dU2 = _backend.empty(E, d, r, **f32), _backend.empty(E, d, r, **f32)
        db2 = _backend.empty(E, d, **f32)
        _lr_bwd_model_kernel[lambda m: (E, triton.cdiv(d, m["BD"]))](
            rt.offs, x, dy, rt.stok, rw, da1, a2, s2, dV1, dU2, db2, d, r, PREC=prec, BM=BM, R=R)
        dw = torch.empty(N * K, **f32).index_copy_(0, rt.order, drw).view(N, K).to(w.dtype)
        ds1 = torch.zeros(E, **f32).index_add_(0, rt.sexp, ds1r)
        ds2 = torch.zeros(E, **f32).index_add_(0, rt.sexp, ds2r)
        grads = [g_.to(p.dtype) for g_, p in zip((dV1, dU1, db1, ds1, dV2, dU2, db2, ds2),
                                                  (V1, U1, b1, s1, V2, U2, b2, s2))]
        return (_sum_slots(dxs, N, K, x.dtype), dw, None, *grads, None)


class _DenseExperts(torch.autograd.Function):
    """Dense experts on routing tiles with grouped GEMMs: x [N, d] → f [N, K, d] (ungated). The
    hidden pre-activation z [N·K, F] is written and kept for backward (unlike the low-rank kernels)."""

    @staticmethod
    def forward(ctx, x, idx, W1, b1, W2, b2):
        N, d = x.shape
        K = idx.shape[1]
        E, _, F = W1.shape
        BM, prec, dev = block_m(), _backend.dot_precision(x), x.device
        rt = Route(idx, E, BM)
        z = _backend.empty(N * K, F, dtype=x.dtype, device=dev)
        _gmm_kernel[lambda m: (rt.T, triton.cdiv(F, m["BN"]))](
            x, rt.stok, W1, b1, z, z, z, rt.tile_e, rt.tile_lo, rt.tile_hi, d, F, d * F, F, 1,
            A_IDX=True, A_GELU=False, BIAS=True, DGELU=False, OUT_IDX=False, PREC=prec, BM=BM)
        fs = _backend.empty(N * K, d, dtype=x.dtype, device=dev)
        _gmm_kernel[lambda m: (rt.T, triton.cdiv(d, m["BN"]))](
            z, z, W2, b2, z, fs, rt.order, rt.tile_e, rt.tile_lo, rt.tile_hi, F, d, F * d, d, 1,
            A_IDX=False, A_GELU=True, BIAS=True, DGELU=False, OUT_IDX=True, PREC=prec, BM=BM)
        ctx.rt = rt
        ctx.save_for_backward(x, z, W1, b1, W2, b2)
        return fs.view(N, K, d)

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, df):
        x, z, W1, b1, W2, b2 = ctx.saved_tensors
        rt = ctx.rt
        N, K, d = df.shape
        E, _, F = W1.shape
        BM, prec, dev = block_m(), _backend.dot_precision(x), x.device
        df = df.reshape(N * K, d).contiguous().to(x.dtype)
        dz = _backend.empty(N * K, F, dtype=x.dtype, device=dev)
        _gmm_kernel[lambda m: (rt.T, triton.cdiv(F, m["BN"]))](
            df, rt.order, W2, b2, z, dz, dz, rt.tile_e, rt.tile_lo, rt.tile_hi, d, F, F * d, 1, d,
            A_IDX=True, A_GELU=False, BIAS=False, DGELU=True, OUT_IDX=False, PREC=prec, BM=BM)
        dxs = _backend.empty(N * K, d, dtype=x.dtype, device=dev)
        _gmm_kernel[lambda m: (rt.T, triton.cdiv(d, m["BN"]))](
            dz, dz, W1, b1, z, dxs, rt.order, rt.tile_e, rt.tile_lo, rt.tile_hi, F, d, d * F, 1, F,
            A_IDX=False, A_GELU=False, BIAS=False, DGELU=False, OUT_IDX=True, PREC=prec, BM=BM)
        f32 = dict(dtype=torch.float32, device=dev)
        dW1, db1 = _backend.empty(E, d, F, **f32), _backend.empty(E, F, **f32)
        _gmm_wgrad_kernel[lambda m: (E, triton.cdiv(d, m["BI"]), triton.cdiv(F, m["BJ"]))](
            rt.offs, x, rt.stok, dz, dz, dW1, db1, d, F,
            A_IDX=True, A_GELU=False, B_IDX=False, BIAS=True, PREC=prec, BM=BM)
        dW2, db2 = _backend.empty(E, F, d, **f32), _backend.empty(E, d, **f32)
        _gmm_wgrad_kernel[lambda m: (E, triton.cdiv(F, m["BI"]), triton.cdiv(d, m["BJ"]))](
            rt.offs, z, z, df, rt.order, dW2, db2, F, d,
            A_IDX=False, A_GELU=True, B_IDX=True, BIAS=True, PREC=prec, BM=BM)
        dx = _sum_slots(dxs, N, K, x.dtype)
        return (dx, None, dW1.to(W1.dtype), db1.to(b1.dtype), dW2.to(W2.dtype), db2.to(b2.dtype))


def moe_triton(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
               experts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Triton MoE: x [N, d], idx [N, K], w [N, K] → [N, d] in x's dtype (fp32 accumulation)."""
    if x.dtype not in _TL_DTYPES:
        raise TypeError(f"the Triton MoE takes fp32/fp16/bf16 x, got {x.dtype}")
    if x.shape[0] == 0 or idx.shape[1] == 0:
        return moe_torch(x, idx, w, experts)
    x, idx = x.contiguous(), idx.contiguous()
    if is_lowrank(experts):
        ex = [experts[k].contiguous() for k in LOWRANK_KEYS]
        # `save`: the caller's grad mode (forward runs under no_grad; needs_input_grad ignores it)
        save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, *ex))
        return _LowRankMoE.apply(x, w, idx, *ex, save)
    ex = [experts[k].contiguous() for k in DENSE_KEYS]
    fs = _DenseExperts.apply(x, idx, *ex)
    return (fs.float() * w.float().unsqueeze(-1)).sum(1).to(x.dtype)
