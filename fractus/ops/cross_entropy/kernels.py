"""The fused head's Triton kernels and their autograd Function: an online log-sum-exp forward over
vocab tiles (lse and the target logit per row, vocab split across programs when few tokens leave
the device idle); a backward that recomputes logits tiles in two kernels, one gridded over token
blocks for dH and one over vocab tiles for dW, no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend
from fractus.ops.cross_entropy.reference import reduce_loss

__all__ = ["gpu_config", "linear_cross_entropy_triton", "tile_config"]


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _token_rows(POS, T, offs_m, M, ignore_index, HAS_POS: tl.constexpr):
    """For the scored rows offs_m: their mask, row indices into h (int64) and targets."""
    mmask = offs_m < M
    if HAS_POS:
        r = tl.load(POS + offs_m, mask=mmask, other=0)
    else:
        r = offs_m
    return mmask, r.to(tl.int64), tl.load(T + offs_m, mask=mmask, other=ignore_index)


@triton.jit
def _vocab_split(V, BLOCK_V: tl.constexpr):
    """This program's vocab split (grid axis 1): its index and the [start, end) of its vocab tiles."""
    pid_s = tl.program_id(1)
    n_tiles = tl.cdiv(V, BLOCK_V)
    per = tl.cdiv(n_tiles, tl.num_programs(1))
    start = pid_s * per
    return pid_s, start, tl.minimum(start + per, n_tiles)


@triton.jit
def _logits_tile(H, W, rows, mmask, offs_v, vmask, D, stride_h, stride_w, softcap,
                 SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """[BLOCK_M, BLOCK_V] fp32 logits (soft-capped) and tanh(raw/cap) (the raw logits without cap)."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    wrow = offs_v.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < D
        a = tl.load(H + rows[:, None] * stride_h + offs_k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(W + wrow + offs_k[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    t = acc
    if SOFTCAP:
        t = _tanh(acc / softcap)
        acc = softcap * t
    return acc, t


@triton.jit
def _dlogits(acc, t, lse, tgt, valid, offs_v, vmask, z2, SOFTCAP: tl.constexpr):
    """d(ce + z·lse²)/d raw logits per row, before the upstream scale: (1 + 2z·lse)·p − onehot."""
    p = tl.where(vmask[None, :], tl.exp(acc - lse[:, None]), 0.0)
    dl = p * (1.0 + z2 * lse)[:, None] - tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
    if SOFTCAP:
        dl = dl * (1.0 - t * t)
    return tl.where(valid[:, None], dl, 0.0)


@triton.jit
def _lce_fwd_kernel(H, W, T, POS, LSE_P, TGT_P, M, V, D, stride_h, stride_w, ignore_index, softcap,
                    HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (token blocks, vocab splits): online log-sum-exp and target logit over the split's
    vocab tiles -> LSE_P[split, M], TGT_P[split, M] (no split is empty, see _n_split)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask, rows, tgt = _token_rows(POS, T, offs_m, M, ignore_index, HAS_POS)
    pid_s, start, end = _vocab_split(V, BLOCK_V)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in range(start, end):
        offs_v = j * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = offs_v < V
        acc, t = _logits_tile(H, W, rows, mmask, offs_v, vmask, D, stride_h, stride_w, softcap,
                              SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_PREC)
        acc = tl.where(vmask[None, :], acc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(acc, axis=1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(acc - m_new[:, None]), axis=1)
        m_i = m_new
        t_i += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], acc, 0.0), axis=1)
    out = pid_s.to(tl.int64) * M + offs_m
    tl.store(LSE_P + out, m_i + tl.log(s_i), mask=mmask)
    tl.store(TGT_P + out, t_i, mask=mmask)


@triton.jit
def _lce_bwd_dh_kernel(H, W, T, POS, LSE, G, DH_P, M, V, D, stride_h, stride_w, ignore_index,
                       softcap, z2, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (token blocks, vocab splits): DH_P[split, M, D] (fp32) = G·Σ_tiles dlogits·W_tile.
    The program owns its rows of DH_P, so it accumulates there without atomics (first tile stores)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask, rows, tgt = _token_rows(POS, T, offs_m, M, ignore_index, HAS_POS)
    valid = tgt != ignore_index
    lse = tl.load(LSE + offs_m, mask=mmask, other=0.0)
    scale = tl.load(G)
    pid_s, start, end = _vocab_split(V, BLOCK_V)
    out = DH_P + (pid_s.to(tl.int64) * M + offs_m.to(tl.int64))[:, None] * D
    for j in range(start, end):
        offs_v = j * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = offs_v < V
        acc, t = _logits_tile(H, W, rows, mmask, offs_v, vmask, D, stride_h, stride_w, softcap,
                              SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_PREC)
        dl = _dlogits(acc, t, lse, tgt, valid, offs_v, vmask, z2, SOFTCAP).to(W.dtype.element_ty)
        seen = tl.minimum(j - start, 1) * D  # 0 on the first tile: store without loading
        wrow = offs_v.to(tl.int64)[:, None] * stride_w
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            wt = tl.load(W + wrow + offs_d[None, :], mask=vmask[:, None] & dmask[None, :], other=0.0)
            part = tl.dot(dl, wt, input_precision=DOT_PREC) * scale
            ptr = out + offs_d[None, :]
            omask = mmask[:, None] & dmask[None, :]
            prev = tl.load(ptr, mask=omask & (offs_d[None, :] < seen), other=0.0)
            tl.store(ptr, prev + part, mask=omask)
            tl.debug_barrier()


@triton.jit
def _lce_bwd_dw_kernel(H, W, T, POS, LSE, G, DW, V0, M, V, D, stride_h, stride_w, ignore_index,
                       softcap, z2, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (vocab tiles from row V0,): DW[v − V0, D] (fp32) = G·Σ_token blocks dlogitsᵀ·h.
    The program owns its vocab rows of DW, so it accumulates there without atomics (the first
    token block stores)."""
    pid_v = tl.program_id(0)
    offs_v = V0 + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    scale = tl.load(G)
    out = DW + (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)[:, None] * D
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mmask, rows, tgt = _token_rows(POS, T, offs_m, M, ignore_index, HAS_POS)
        valid = tgt != ignore_index
        lse = tl.load(LSE + offs_m, mask=mmask, other=0.0)
        acc, t = _logits_tile(H, W, rows, mmask, offs_v, vmask, D, stride_h, stride_w, softcap,
                              SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_PREC)
        seen = tl.minimum(m0, 1) * D  # 0 on the first token block: store without loading
        dlt = tl.trans(_dlogits(acc, t, lse, tgt, valid, offs_v, vmask, z2, SOFTCAP).to(H.dtype.element_ty))
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dmask = offs_d < D
            x = tl.load(H + rows[:, None] * stride_h + offs_d[None, :],
                        mask=mmask[:, None] & dmask[None, :], other=0.0)
            part = tl.dot(dlt, x, input_precision=DOT_PREC) * scale
            ptr = out + offs_d[None, :]
            omask = vmask[:, None] & dmask[None, :]
            prev = tl.load(ptr, mask=omask & (offs_d[None, :] < seen), other=0.0)
            tl.store(ptr, prev + part, mask=omask)
            tl.debug_barrier()


_H200_SMS = 132  # streaming multiprocessors assumed when compiling ahead of time without a GPU


def gpu_config(dtype: torch.dtype, sms: int = _H200_SMS) -> dict:
    """The GPU's tile sizes by dtype on a device of ``sms`` multiprocessors (tests run them in the
    interpreter too). programs: grid size worth filling; slab_tiles: vocab tiles per dW launch (one wave).
    DW_BLOCK_M / DW_BLOCK_V: the dW kernel's token block and vocab tile. Its program adds each
    token block's product into its [DW_BLOCK_V, d] fp32 rows of dW in memory (a read and a write),
    so a larger token block means fewer such passes per FLOP, and a narrower vocab tile fewer rows
    per wave (1b head, bf16, 128 × 64: 132 × 64 × 1280 × 4 B = 43 MB, within the 60 MB of L2
    PyTorch reports on an H200). Against the forward's 64 × 128 that halves both, with fewer
    registers (sm_90: 174 vs 218), and doubles the reads of h, shared by a wave's programs."""
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32, BLOCK_D=64, DW_BLOCK_M=64, DW_BLOCK_V=64,
                    num_warps=4, num_stages=2, programs=2 * sms, slab_tiles=sms)
    return dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=64, BLOCK_D=64, DW_BLOCK_M=128, DW_BLOCK_V=64,
                num_warps=8, num_stages=3, programs=2 * sms, slab_tiles=sms)


def tile_config(h: torch.Tensor, V: int) -> dict:
    """Tile sizes: interpreter tiles are small so tests span several tiles; GPU tiles by dtype."""
    if _backend.interpreting():
        return dict(BLOCK_M=16, BLOCK_V=32 if V <= 4096 else 128, BLOCK_K=32, BLOCK_D=32, DW_BLOCK_M=32,
                    DW_BLOCK_V=16 if V <= 4096 else 128, num_warps=4, num_stages=1, programs=2, slab_tiles=4)
    return gpu_config(h.dtype, torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda
                      else _H200_SMS)


def _n_split(M: int, V: int, cfg: dict) -> int:
    """Vocab splits so that (token blocks × splits) fills the device when there are few tokens.
    S = cdiv(tiles, cdiv(tiles, wanted)) leaves no split empty: the kernels rely on it."""
    m_blocks = triton.cdiv(M, cfg["BLOCK_M"])
    n_tiles = triton.cdiv(V, cfg["BLOCK_V"])
    wanted = max(1, min(n_tiles, cfg["programs"] // m_blocks))
    return triton.cdiv(n_tiles, triton.cdiv(n_tiles, wanted))


class _TritonLCE(torch.autograd.Function):
    """Forward writes only lse and the target logit per row; backward recomputes logits tiles."""

    @staticmethod
    def forward(ctx, h, weight, t, positions, ignore_index, reduction, z_loss, softcap):
        h_, w_ = h.detach().contiguous(), weight.detach().contiguous()
        if w_.dtype != h_.dtype:
            w_ = w_.to(h_.dtype)
        M, (V, D) = t.shape[0], w_.shape
        t = t.contiguous()
        pos = positions if positions is not None else t
        cfg = tile_config(h_, V)
        valid = t != ignore_index
        if M == 0:
            lse = torch.zeros(0, dtype=torch.float32, device=h.device)
            ce = lse.clone()
        else:
            S = _n_split(M, V, cfg)
            lse_p = _backend.empty(S, M, dtype=torch.float32, device=h.device)
            tgt_p = _backend.empty(S, M, dtype=torch.float32, device=h.device)
            grid = (triton.cdiv(M, cfg["BLOCK_M"]), S)
            _lce_fwd_kernel[grid](
                h_, w_, t, pos, lse_p, tgt_p, M, V, D, h_.stride(0), w_.stride(0), ignore_index,
                float(softcap or 1.0), HAS_POS=positions is not None, SOFTCAP=softcap is not None,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=cfg["BLOCK_K"],
                DOT_PREC=_backend.dot_precision(h_), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            lse = torch.logsumexp(lse_p, dim=0)
            ce = torch.where(valid, lse - tgt_p.sum(0), torch.zeros_like(lse))
        ctx.save_for_backward(h_, w_, t, positions, lse)
        ctx.args = (ignore_index, reduction, z_loss, softcap, cfg, h.dtype, weight.dtype, h.shape[0])
        loss = reduce_loss(ce, lse, valid, reduction, z_loss)
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, g_loss, g_ce):
        h_, w_, t, positions, lse = ctx.saved_tensors
        ignore_index, reduction, z_loss, softcap, cfg, h_dtype, w_dtype, N = ctx.args
        M, (V, D) = t.shape[0], w_.shape
        dev = h_.device
        g = g_loss.float().reshape(1)
        if reduction == "mean":
            g = g / (t != ignore_index).sum().clamp_min(1)
        pos = positions if positions is not None else t
        common = dict(HAS_POS=positions is not None, SOFTCAP=softcap is not None, BLOCK_K=cfg["BLOCK_K"],
                      BLOCK_D=cfg["BLOCK_D"], DOT_PREC=_backend.dot_precision(h_), num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"])
        dh_tiles = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"])
        dw_tiles = dict(BLOCK_M=cfg["DW_BLOCK_M"], BLOCK_V=cfg["DW_BLOCK_V"])
        args = (M, V, D, h_.stride(0), w_.stride(0), ignore_index, float(softcap or 1.0),
                2.0 * z_loss)
        dH = dW = None
        if ctx.needs_input_grad[0]:
            if M == 0:
                dH = torch.zeros(N, D, dtype=h_dtype, device=dev)
            else:
                S = _n_split(M, V, cfg)
                dh_p = _backend.empty(S, M, D, dtype=torch.float32, device=dev)
                grid = (triton.cdiv(M, cfg["BLOCK_M"]), S)
                _lce_bwd_dh_kernel[grid](h_, w_, t, pos, lse, g, dh_p, *args, **dh_tiles, **common)
                dH = dh_p[0] if S == 1 else dh_p.sum(0)
                if positions is not None:
                    dH = torch.zeros(N, D, dtype=torch.float32, device=dev).index_add_(0, positions, dH)
                dH = dH.to(h_dtype)
        if ctx.needs_input_grad[1]:
            if M == 0:
                dW = torch.zeros(V, D, dtype=w_dtype, device=dev)
            elif w_dtype == torch.float32:
                dW = _backend.empty(V, D, dtype=torch.float32, device=dev)
                grid = (triton.cdiv(V, cfg["DW_BLOCK_V"]),)
                _lce_bwd_dw_kernel[grid](h_, w_, t, pos, lse, g, dW, 0, *args, **dw_tiles, **common)
            else:  # fp32 accumulation in a reused slab of whole waves of vocab tiles, then cast
                dW = _backend.empty(V, D, dtype=w_dtype, device=dev)
                rows = cfg["slab_tiles"] * cfg["DW_BLOCK_V"]
                slab = _backend.empty(min(rows, V), D, dtype=torch.float32, device=dev)
                for v0 in range(0, V, rows):
                    n = min(rows, V - v0)
                    grid = (triton.cdiv(n, cfg["DW_BLOCK_V"]),)
                    _lce_bwd_dw_kernel[grid](h_, w_, t, pos, lse, g, slab, v0, *args, **dw_tiles, **common)
                    dW[v0:v0 + n].copy_(slab[:n])
        return dH, dW, None, None, None, None, None, None


def linear_cross_entropy_triton(h, weight, t, positions, ignore_index, reduction, z_loss, softcap):
    """(loss, per-token ce) of the scored rows on the Triton path (checked arguments: targets ``t``
    [M] of the scored rows, ``positions`` contiguous or None)."""
    return _TritonLCE.apply(h, weight, t, positions, ignore_index, reduction, z_loss, softcap)
