"""The multi-level linear attention's reference: the recurrence of :mod:`fractus.ops.linear_attention`
one position at a time in fp32 (fp64 for fp64 inputs, which the tests use as the truth), and the
argument checks every path shares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops.common import level_decays

__all__ = ["check_inputs", "linear_attention_reference"]


def check_inputs(q, k, v, level_weights, omegas, decay, state, resets=None):
    """ValueError or TypeError, naming the argument, unless the shapes and dtypes are those of the
    package docstring (a fixed decay's range too, where checking it costs no device sync)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be [B, T, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, D = q.shape
    Lv = len(omegas)
    if T < 1 or Lv < 1:
        raise ValueError(f"need T >= 1 and at least one level; got T={T}, {Lv} levels")
    if level_weights.shape != (Lv,):
        raise ValueError(f"level_weights must be [Lv]={Lv}, got {tuple(level_weights.shape)}")
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise TypeError(f"q, k, v must be floating, got {q.dtype}, {k.dtype}, {v.dtype}")
    shapes = ((H,), (Lv, H), (B, T, H), (B, T, Lv, H))
    if decay is not None and (not torch.is_tensor(decay) or decay.shape not in shapes):
        raise ValueError(f"decay must be None or a tensor [H]={shapes[0]}, [Lv, H]={shapes[1]}, [B, T, H]={shapes[2]} "
                         f"or [B, T, Lv, H]={shapes[3]}, got {getattr(decay, 'shape', decay)}")
    # a fixed decay is checked where it costs no device sync; one per position is a model's own
    # activation (the decay gate's, in (0, 1] by construction), like q, k and v not checked
    if decay is not None and decay.dim() <= 2 and not decay.is_cuda and not bool(((decay > 0) & (decay <= 1)).all()):
        raise ValueError(f"decay must lie in (0, 1], got {decay.tolist()}")
    if resets is not None and (not torch.is_tensor(resets) or resets.dtype != torch.bool or resets.shape != (B, T)):
        raise ValueError(f"resets must be None or a [B, T]={(B, T)} bool tensor, got {getattr(resets, 'shape', resets)}")
    if state is not None:
        S, z = state
        if S.shape != (B, Lv, H, D, D) or z.shape != (B, Lv, H, D):
            raise ValueError(f"state must be (S [B, Lv, H, D, D], z [B, Lv, H, D]) = "
                             f"({(B, Lv, H, D, D)}, {(B, Lv, H, D)}); got "
                             f"({tuple(S.shape)}, {tuple(z.shape)})")


def linear_attention_reference(q, k, v, level_weights, omegas, decay=None, state=None, eps=1e-6,
                               normalize=True, resets=None):
    """The recurrence above, one position at a time in fp32 (fp64 for fp64 inputs, which tests
    use as the truth). Returns (o, (S, z))."""
    check_inputs(q, k, v, level_weights, omegas, decay, state, resets)
    B, T, H, D = q.shape
    Lv = len(omegas)
    dt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    w = level_weights.to(dt)
    gam = level_decays(decay, B, T, Lv, H, dt, q.device)
    if state is None:
        S = torch.zeros(B, Lv, H, D, D, dtype=dt, device=q.device)
        z = torch.zeros(B, Lv, H, D, dtype=dt, device=q.device)
    else:
        S, z = state[0].to(dt), state[1].to(dt)
    outs = []
    for t in range(T):
        fq = torch.stack([F.elu(qf[:, t] + om) + 1 for om in omegas], 1)  # [B, Lv, H, D]
        fk = torch.stack([F.elu(kf[:, t] + om) + 1 for om in omegas], 1)
        if resets is not None:
            keep = (~resets[:, t]).to(dt)
            S, z = S * keep.view(B, 1, 1, 1, 1), z * keep.view(B, 1, 1, 1)
        g = gam[:, min(t, gam.shape[1] - 1)]  # [B or 1, Lv, H]
        S = g[..., None, None] * S + fk[..., :, None] * vf[:, t, None, :, None, :]
        z = g[..., None] * z + fk
        num = torch.einsum("blhd,blhde->blhe", fq, S)
        y = num / ((fq * z).sum(-1, keepdim=True) + eps) if normalize else num
        outs.append(torch.einsum("l,blhe->bhe", w, y))
    return torch.stack(outs, 1).to(q.dtype), (S, z)
