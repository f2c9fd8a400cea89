"""The gated delta rule one position at a time, in fp32 (fp64 for fp64 inputs): the truth the
other paths are tested against; and the argument checks and unit feature vectors they share."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops.common import level_decays

__all__ = ["check_inputs", "delta_rule_reference", "unit_features"]


def check_inputs(q, k, v, beta, omegas):
    B, T, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, len(omegas), H):
        raise ValueError(f"beta must be [B, T, Lv, H] = {[B, T, len(omegas), H]}, got {list(beta.shape)}")


def unit_features(x: torch.Tensor, omegas) -> torch.Tensor:
    """[B, ..., H, D] → unit feature vectors [B, Lv, ..., H, D], one per level."""
    return torch.stack([F.normalize(F.elu(x + om) + 1, dim=-1) for om in omegas], 1)


def delta_rule_reference(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None):
    """The recurrence above, one position at a time in fp32 (fp64 for fp64 inputs). Returns (o, S)."""
    check_inputs(q, k, v, beta, omegas)
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
        fq, fk = unit_features(qf[:, t], omegas), unit_features(kf[:, t], omegas)  # [B, Lv, H, D]
        S = gam[:, min(t, gam.shape[1] - 1), :, :, None, None] * S
        recalled = torch.einsum("blhd,blhde->blhe", fk, S)
        S = S + (bf[:, t, :, :, None] * fk)[..., :, None] * (vf[:, t, None] - recalled)[..., None, :]
        y = torch.einsum("blhd,blhde->blhe", fq, S)
        outs.append(torch.einsum("l,blhe->bhe", level_weights.to(dt), y))
    return torch.stack(outs, 1).to(q.dtype), S
