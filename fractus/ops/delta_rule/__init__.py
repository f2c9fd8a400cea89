"""The gated delta rule on the multi-level features: a state that overwrites what it recalls.

Shapes: q, k, v [B, T, H, D] (pre feature map, any float dtype); level_weights [Lv] (already
softmaxed); omegas Lv python floats; beta [B, T, Lv, H] in (0, 1), each position's write strength;
decay None, [H], [Lv, H] or one per position [B, T, Lv, H], in (0, 1]; state None or
S [B, Lv, H, D, D] fp32; resets None or [B, T] bool (the state starts afresh before those
positions). Per level l, with the linear attention's feature map f_l(u) = elu(u + ω_l) + 1 made a
unit vector, k̂ = f_l(k)/‖f_l(k)‖ and q̂ = f_l(q)/‖f_l(q)‖, and per (b, l, h), inclusive of t:

    S_t = γ_t·S_{t−1} + β_t·k̂_t (v_t − (γ_t·S_{t−1})ᵀ k̂_t)ᵀ,   y_{l,t} = q̂_tᵀ S_t,
    o_t = Σ_l level_weights[l]·y_{l,t}

(the delta rule of DeltaNet, with a decay as in Gated DeltaNet). Where the linear attention adds
f(k) vᵀ to its state, this moves what the state recalls for k̂ a fraction β towards v: a key
written twice with β = 1 recalls its second value only. There is no denominator: the model reads
it through its per-head RMSNorm (``attn_norm="rms"``).

Returns o [B, T, H, D] in q's dtype and S after the last position, fp32 (fp64 for fp64 inputs).
Two paths: :func:`delta_rule_reference`, one position at a time, and the chunked form the model
runs on every device (:func:`delta_rule_chunked`; no Triton kernel: a lever, not a default). With
no kernels and two short paths, the op is this one module rather than the reference / PyTorch /
kernels modules of the others.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops import common as _backend
from fractus.ops.common import level_decays

__all__ = ["delta_rule", "delta_rule_chunked", "delta_rule_reference"]

_CHUNK = 64


def _check(q, k, v, beta, omegas):
    B, T, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, len(omegas), H):
        raise ValueError(f"beta must be [B, T, Lv, H] = {[B, T, len(omegas), H]}, got {list(beta.shape)}")


def _unit_features(x: torch.Tensor, omegas) -> torch.Tensor:
    """[B, ..., H, D] → unit feature vectors [B, Lv, ..., H, D], one per level."""
    return torch.stack([F.normalize(F.elu(x + om) + 1, dim=-1) for om in omegas], 1)


def delta_rule_reference(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None):
    """The recurrence above, one position at a time in fp32 (fp64 for fp64 inputs). Returns (o, S)."""
    _check(q, k, v, beta, omegas)
    B, T, H, D = q.shape
    Lv = len(omegas)
    dt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, bf = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    gam = level_decays(decay, B, T, Lv, H, dt, q.device)  # [B or 1, T or 1, Lv, H], as the linear attention's
    S = torch.zeros(B, Lv, H, D, D, dtype=dt, device=q.device) if state is None else state.to(dt)
    outs = []
    for t in range(T):
        if resets is not None:
            S = S * (~resets[:, t]).to(dt).view(B, 1, 1, 1, 1)
        fq, fk = _unit_features(qf[:, t], omegas), _unit_features(kf[:, t], omegas)  # [B, Lv, H, D]
        S = gam[:, min(t, gam.shape[1] - 1), :, :, None, None] * S
        recalled = torch.einsum("blhd,blhde->blhe", fk, S)
        S = S + (bf[:, t, :, :, None] * fk)[..., :, None] * (vf[:, t, None] - recalled)[..., None, :]
        y = torch.einsum("blhd,blhde->blhe", fq, S)
        outs.append(torch.einsum("l,blhe->bhe", level_weights.to(dt), y))
    return torch.stack(outs, 1).to(q.dtype), S


def delta_rule_chunked(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None, C=_CHUNK):
    """The same recurrence in chunks of C positions, with plain autograd (the WY form of DeltaNet).

    Within a chunk, with b_t = Σ_{j ≤ t} log γ_j and u_t = β_t (v_t − (γ_t S_{t−1})ᵀ k̂_t) the value a
    position actually writes, S_t = e^{b_t} S₀ + Σ_{i ≤ t} e^{b_t − b_i} k̂_i u_iᵀ. The u of a chunk
    solve one unit lower-triangular system, (I + diag(β)·(k̂k̂ᵀ ⊙ e^{b_t − b_i})_{i<t}) U = diag(β)(V −
    diag(e^b) K̂ S₀), so U = U' − W S₀ with U', W computed for every chunk at once; only U and the
    chunk's end state S₀ ← e^{b_C} S₀ + K̂ᵀ diag(e^{b_C − b}) U run chunk after chunk. A reset cuts a
    chunk into segments: positions reach each other, and the start or end state, only within one."""
    _check(q, k, v, beta, omegas)
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
    fq = _unit_features(chunked(q.to(dt)), omegas)
    fk = _unit_features(chunked(k.to(dt)), omegas)
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
    U1 = torch.linalg.solve_triangular(L, bt[..., None] * vc.expand_as(fk), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, (bt * g0)[..., None] * fk, upper=False, unitriangular=True)
    kw = (fk * gC[..., None]).transpose(-1, -2)  # [B, Lv, H, n, D, C]
    decayC = torch.exp(b[..., -1].to(dt))[..., None, None] * carry  # [B, Lv, H, n, 1, 1]
    S = torch.zeros(B, Lv, H, D, D, dtype=dt, device=q.device) if state is None else state.to(dt)
    starts, us = [], []
    for c in range(n):
        starts.append(S)
        u = U1[:, :, :, c] - W[:, :, :, c] @ S
        us.append(u)
        S = decayC[:, :, :, c] * S + kw[:, :, :, c] @ u
    U = torch.stack(us, 3)
    y = (fq * g0[..., None]) @ torch.stack(starts, 3) + ((fq @ fk.transpose(-1, -2)) * incl) @ U  # [B, Lv, H, n, C, D]
    o = torch.einsum("l,blhtd->bthd", level_weights.to(dt), y.reshape(B, Lv, H, n * C, D))[:, :T]
    return o.to(q.dtype).contiguous(), S


def delta_rule(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None, backend="auto"):
    """The gated delta rule (see the module docstring). backend "reference" runs it one position at
    a time; every other backend the chunked form in PyTorch. Returns (o [B, T, H, D], S
    [B, Lv, H, D, D]); differentiable in q, k, v, level_weights, beta, decay and state."""
    if _backend.pick(backend, q) == "reference":
        return delta_rule_reference(q, k, v, level_weights, omegas, beta, decay, state, resets)
    return delta_rule_chunked(q, k, v, level_weights, omegas, beta, decay, state, resets)
