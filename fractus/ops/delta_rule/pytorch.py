"""The gated delta rule in chunks, in PyTorch with plain autograd: the path every CPU run takes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops.common import level_decays
from fractus.ops.delta_rule.reference import check_inputs, unit_features

__all__ = ["CHUNK", "delta_rule_chunked"]

CHUNK = 32  # fastest on one CPU thread at palier0's shape (16: within noise; 64: 15 % slower)


def delta_rule_chunked(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None, C=CHUNK):
    """The same recurrence in chunks of C positions, with plain autograd (the WY form of DeltaNet).

    Within a chunk, with b_t = Σ_{j ≤ t} log γ_j and u_t = β_t (v_t − (γ_t S_{t−1})ᵀ k̂_t) the value a
    position actually writes, S_t = e^{b_t} S₀ + Σ_{i ≤ t} e^{b_t − b_i} k̂_i u_iᵀ. The u of a chunk
    solve one unit lower-triangular system, (I + diag(β)·(k̂k̂ᵀ ⊙ e^{b_t − b_i})_{i<t}) U = diag(β)(V −
    diag(e^b) K̂ S₀), so U = U' − W S₀ with U', W computed for every chunk at once; only U and the
    chunk's end state S₀ ← e^{b_C} S₀ + K̂ᵀ diag(e^{b_C − b}) U run chunk after chunk. A reset cuts a
    chunk into segments: positions reach each other, and the start or end state, only within one."""
    check_inputs(q, k, v, beta, omegas)
    B, T, H, D = q.shape
    Lv = len(omegas)
    dt = torch.promote_types(q.dtype, torch.float32)
    C = min(C, T)
    n = -(-T // C)
    pad = n * C - T

    def chunked(x):  # [B, T, ...] → [B, n, C, ...], zero-padded at the end
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        return x.reshape(B, n, C, *x.shape[2:])

    # [B, Lv, n, C, H, D] features; v, β, log γ as [B, 1 or Lv, n, C, H(, D)]
    fq = unit_features(chunked(q.to(dt)), omegas)
    fk = unit_features(chunked(k.to(dt)), omegas)
    vc = chunked(v.to(dt))[:, None]
    bt = chunked(beta.to(dt)).permute(0, 3, 1, 2, 4)  # [B, Lv, n, C, H]
    gam = level_decays(decay, B, T, Lv, H, dt, q.device)
    lg = torch.log(gam).expand(B, T, Lv, H)
    lg = chunked(lg).permute(0, 3, 1, 2, 4)  # padded positions: γ = 1
    # to [B, Lv, H, n, C, ·]: one (level, head) per leading index
    fq, fk, vc = (x.permute(0, 1, 4, 2, 3, 5) for x in (fq, fk, vc))
    bt, lg = (x.permute(0, 1, 4, 2, 3) for x in (bt, lg))
    b = lg.double().cumsum(-1)  # [B, Lv, H, n, C], in fp64 so that differences keep fp32's accuracy
    i = torch.arange(C, device=q.device)
    same = torch.ones(C, C, dtype=torch.bool, device=q.device)
    start = torch.ones(B, 1, 1, n, C, dtype=torch.bool, device=q.device)  # reads the chunk's start state
    end = start  # reaches the chunk's end state
    carry = torch.ones(B, 1, 1, n, 1, 1, dtype=dt, device=q.device)  # the start state survives the chunk
    if resets is not None:
        r = F.pad(resets, (0, pad)) if pad else resets
        seg = r.view(B, 1, 1, n, C).cumsum(-1)  # resets so far in the chunk
        same = seg[..., :, None] == seg[..., None, :]
        start, end = seg == 0, seg == seg[..., -1:]
        carry = (seg[..., -1:, None] == 0).to(dt)
    gap = (b[..., :, None] - b[..., None, :]).to(dt)  # b_t − b_i [.., C, C]
    incl = torch.exp(gap.masked_fill(~((i[:, None] >= i[None, :]) & same), float("-inf")))
    strict = incl.masked_fill(i[:, None] == i[None, :], 0.0)
    g0 = torch.exp(b.to(dt)) * start  # e^{b_t}: decay from the chunk's start state
    gC = torch.exp((b[..., -1:] - b).to(dt)) * end  # e^{b_C − b_t}: to the chunk's end
    L = torch.eye(C, dtype=dt, device=q.device) + bt[..., :, None] * (fk @ fk.transpose(-1, -2)) * strict
    rhs = torch.cat([bt[..., None] * vc.expand_as(fk), (bt * g0)[..., None] * fk], -1)  # one solve for both
    U1, W = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True).split(D, -1)
    kw = (fk * gC[..., None]).transpose(-1, -2)  # [B, Lv, H, n, D, C]
    decayC = torch.exp(b[..., -1].to(dt))[..., None, None] * carry  # [B, Lv, H, n, 1, 1]
    S = torch.zeros(B, Lv, H, D, D, dtype=dt, device=q.device) if state is None else state.to(dt)
    starts, us = [], []
    # unbind, not an index per chunk: each index's backward would fill a zero tensor of the whole size
    for u1, w, dc, k_w in zip(U1.unbind(3), W.unbind(3), decayC.unbind(3), kw.unbind(3)):
        starts.append(S)
        u = u1 - w @ S
        us.append(u)
        S = dc * S + k_w @ u
    U = torch.stack(us, 3)
    y = (fq * g0[..., None]) @ torch.stack(starts, 3) + ((fq @ fk.transpose(-1, -2)) * incl) @ U  # [B, Lv, H, n, C, D]
    o = torch.einsum("l,blhtd->bthd", level_weights.to(dt), y.reshape(B, Lv, H, n * C, D))[:, :T]
    return o.to(q.dtype).contiguous(), S
