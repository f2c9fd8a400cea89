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

Returns o [B, T, H, D] in q's dtype and S after the last position, fp32. One position at a time
on every device: :func:`delta_rule` is both the reference and the path the model runs (no chunked
form and no Triton kernel: a lever being measured, not a default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.kernels.linear_attention import _level_decays

__all__ = ["delta_rule"]


def _unit_features(x: torch.Tensor, omegas) -> torch.Tensor:
    """[B, H, D] → unit feature vectors [B, Lv, H, D], one per level."""
    return torch.stack([F.normalize(F.elu(x + om) + 1, dim=-1) for om in omegas], 1)


def delta_rule(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None):
    """The recurrence above, one position at a time in fp32 (fp64 for fp64 inputs). Returns (o, S)."""
    B, T, H, D = q.shape
    Lv = len(omegas)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, Lv, H):
        raise ValueError(f"beta must be [B, T, Lv, H] = {[B, T, Lv, H]}, got {list(beta.shape)}")
    dt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, bf = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    gam = _level_decays(decay, B, T, Lv, H, dt, q.device)  # [B or 1, T or 1, Lv, H], as the linear attention's
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
