"""The multi-level linear attention's chunked PyTorch path, the CPU's: levels folded into the head
axis, the denominator as a ones column appended to v (numerator and denominator one [D, D + 1]
state), positions in chunks with the state carried from chunk to chunk; plain autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops.common import level_decays

__all__ = ["linear_attention_torch"]

_CPU_CHUNK = 64


def _fold_features(x, omegas):
    """[B, T, H, D] -> fp32 features [B, Lv·H, T, D], level-major (index l·H + h)."""
    x = x.float().transpose(1, 2).contiguous()
    feats = [F.elu(x + om).add_(1.0) for om in omegas]
    return torch.cat(feats, dim=1) if len(feats) > 1 else feats[0]


def _chunks(fq, fk, ve, S, lg, C, r=None):
    """Equal chunks of C positions. fq, fk [B, N, n·C, D]; ve [B, N, n·C, E] (v with a ones
    column); S [B, N, D, E] the state before the first position; lg the log-decay per position
    [B or 1, N, n·C], or None; r [B, n·C] bool resets or None. Returns the unnormalised outputs
    [B, N, n·C, E] and the state after the last position."""
    B, N, TT, D = fq.shape
    E = ve.shape[-1]
    n = TT // C
    q = fq.reshape(B, N, n, C, D)
    k = fk.reshape(B, N, n, C, D)
    v = ve.reshape(B, N, n, C, E)
    i = torch.arange(C, device=fq.device)
    causal = i[:, None] >= i[None, :]
    if lg is None:
        A = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        kw, qw, gC = k, q, None
    else:  # b_i = Σ_{j ≤ i} log γ_j within the chunk: position j reaches i ≥ j decayed by exp(b_i − b_j);
        # b in fp64, so that its differences keep fp32's relative accuracy however far b has run
        b = lg.reshape(lg.shape[0], N, n, C).double().cumsum(-1)  # [B or 1, N, n, C]
        M = torch.exp((b[..., :, None] - b[..., None, :]).float().masked_fill(~causal, float("-inf")))  # [.., C, C]
        A = (q @ k.transpose(-1, -2)) * M
        kw = k * torch.exp((b[..., -1:] - b).float())[..., None]  # to the chunk's end
        qw = q * torch.exp(b.float())[..., None]  # from the chunk's start state
        gC = torch.exp(b[..., -1].float())[..., None, None].unbind(2)  # the start state's decay over the chunk
    carry = None
    if r is not None:  # a position reaches another iff no reset lies after the first, up to the second
        seg = r.view(B, n, C).cumsum(-1)  # resets so far in the chunk [B, n, C]
        A = A * (seg[..., :, None] == seg[..., None, :])[:, None]
        qw = qw * (seg == 0)[:, None, :, :, None]  # before the chunk's first reset: they read its start state
        kw = kw * (seg == seg[..., -1:])[:, None, :, :, None]  # after its last reset: they reach its end state
        carry = (seg[..., -1] == 0).to(S.dtype).view(B, 1, n, 1, 1).unbind(2)  # the start state survives
    delta = kw.transpose(-1, -2) @ v  # [B, N, n, D, E]
    starts = []
    for c, d in enumerate(delta.unbind(2)):
        starts.append(S)
        if carry is not None:
            S = S * carry[c]
        S = S + d if gC is None else gC[c] * S + d
    with torch.autocast(fq.device.type, enabled=False):  # fp32: see the note on the Triton state dots
        inter = qw @ torch.stack(starts, 2)
    y = inter + A @ v
    return y.reshape(B, N, TT, E), S


def _one_position(q, k, v, level_weights, omegas, decay, state, eps, normalize, resets):
    """T = 1 (decoding) as the recurrence itself, a dozen ops instead of the chunks' machinery:
    S ← γ·S + f(k) vᵀ, z ← γ·z + f(k), y = Σ_l w_l·f_l(q)ᵀS / (f_l(q)ᵀz + ε), in fp32."""
    B, _, H, D = q.shape
    Lv = len(omegas)
    om = torch.tensor(omegas, dtype=torch.float32).view(1, Lv, 1, 1).to(q.device, non_blocking=True)
    fq = F.elu(q.float().view(B, 1, H, D) + om).add_(1.0)  # [B, Lv, H, D]
    fk = F.elu(k.float().view(B, 1, H, D) + om).add_(1.0)
    if state is None:
        S, z = q.new_zeros(B, Lv, H, D, D, dtype=torch.float32), q.new_zeros(B, Lv, H, D, dtype=torch.float32)
    else:
        S, z = state[0].float(), state[1].float()
    if resets is not None:  # the state starts afresh before a reset
        keep = (~resets.view(B)).float().view(B, 1, 1, 1)
        S, z = S * keep[..., None], z * keep
    if decay is not None:
        gam = level_decays(decay, B, 1, Lv, H, torch.float32, q.device).view(-1, Lv, H, 1)
        S, z = S * gam[..., None], z * gam
    S = torch.addcmul(S, fk[..., :, None], v.float().view(B, 1, H, 1, D))
    z = z + fk
    w = level_weights.float().view(1, Lv, 1, 1)
    with torch.autocast(q.device.type, enabled=False):  # the state read in fp32, as the chunks' is
        o = (fq[..., None, :] @ S).squeeze(-2)  # [B, Lv, H, D]
    o = o * (w / ((fq * z).sum(-1, keepdim=True) + eps) if normalize else w)
    return o.sum(1).view(B, 1, H, D).to(q.dtype), (S, z)


def linear_attention_torch(q, k, v, level_weights, omegas, decay, state, eps, normalize=True, resets=None):
    """Chunked forward in fp32 with plain autograd; cost linear in T, no [B, T, D, D] tensor.
    Under autocast the matmuls within a chunk take its dtype (as the Triton kernels' dots take the
    inputs'); the state is summed, and multiplied with the queries, in fp32. fp64 inputs are
    computed in fp32 too (and returned in fp64): the fp64 path is the reference's. One position
    (T = 1, decoding) takes the recurrence itself."""
    B, T, H, D = q.shape
    if T == 1:
        return _one_position(q, k, v, level_weights, omegas, decay, state, eps, normalize, resets)
    Lv = len(omegas)
    N = Lv * H
    fq, fk = _fold_features(q, omegas), _fold_features(k, omegas)
    vt = v.float().transpose(1, 2)  # [B, H, T, D] (made contiguous by the cat below)
    ve = torch.cat([vt, torch.ones_like(vt[..., :1])], -1)  # [B, H, T, D+1]
    if Lv > 1:
        ve = ve.repeat(1, Lv, 1, 1)  # [B, N, T, D+1]
    if state is None:
        S = torch.zeros(B, N, D, D + 1, device=q.device)
    else:
        S = torch.cat([state[0].float(), state[1].float()[..., None]], -1).reshape(B, N, D, D + 1)
    lg = None
    if decay is not None:  # [B or 1, N, T]
        gam = level_decays(decay, B, T, Lv, H, torch.float32, q.device)
        lg = torch.log(gam).reshape(gam.shape[0], gam.shape[1], N).transpose(1, 2).expand(-1, N, T)
    C = min(_CPU_CHUNK, T)
    full = (T // C) * C
    ys = []
    r = (None, None) if resets is None else (resets[:, :full], resets[:, full:])
    lgs = (None, None) if lg is None else (lg[..., :full], lg[..., full:])
    y, S = _chunks(fq[:, :, :full], fk[:, :, :full], ve[:, :, :full], S, lgs[0], C, r[0])
    ys.append(y)
    if full < T:
        y, S = _chunks(fq[:, :, full:], fk[:, :, full:], ve[:, :, full:], S, lgs[1], T - full, r[1])
        ys.append(y)
    y = torch.cat(ys, 2) if len(ys) > 1 else ys[0]
    # w_l / (den + eps) on the [B, N, T, 1] column, then one pass over the numerator
    scale = level_weights.float().repeat_interleave(H).view(1, N, 1, 1)
    o = y[..., :D] * (scale / (y[..., D:] + eps) if normalize else scale)  # [B, N, T, D]
    o = o.view(B, Lv, H, T, D).sum(1) if Lv > 1 else o
    S = S.reshape(B, Lv, H, D, D + 1)
    return o.transpose(1, 2).to(q.dtype).contiguous(), (S[..., :D], S[..., D])
