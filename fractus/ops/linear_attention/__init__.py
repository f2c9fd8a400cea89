"""Multi-level causal linear attention with carried state.

Shapes: q, k, v [B, T, H, D] (pre feature map, any float dtype); level_weights [Lv] (already
softmaxed); omegas Lv python floats; decay None, [H] or [Lv, H] in (0, 1], or one per position
[B, T, H] or [B, T, Lv, H] (a data-dependent decay); state None or
(S [B, Lv, H, D, D] fp32, z [B, Lv, H, D] fp32). Per level l the feature map is
f_l(u) = elu(u + ω_l) + 1 and, per (b, l, h), inclusive of position t:

    S_t = γ_t·S_{t−1} + f_l(k_t) v_tᵀ,   z_t = γ_t·z_{t−1} + f_l(k_t)   (γ_t = γ for a fixed decay)
    y_{l,t} = f_l(q_t)ᵀ S_t / (f_l(q_t)ᵀ z_t + eps),   o_t = Σ_l level_weights[l]·y_{l,t}

Returns o [B, T, H, D] in q's dtype and the state after the last position (S, z) in fp32.

The paths, one module each: :mod:`.reference` (the fp32 token-by-token reference, and the argument
checks), :mod:`.pytorch` (the chunked PyTorch path: levels folded into the head axis, the
denominator as a ones column appended to v, state carried chunk to chunk) and :mod:`.kernels` (the
Triton kernels: a sequential chunk-state pass plus a parallel output pass; backward recomputes
chunk states and runs the reverse recurrence, from each level's output y and denominator kept in
fp32 by the forward; a one-launch decode kernel for small T). :func:`linear_attention` dispatches
between them through :func:`fractus.ops.common.pick`.
"""
from __future__ import annotations

import torch

from fractus.ops import common as _backend
from fractus.ops.linear_attention.kernels import linear_attention_triton
from fractus.ops.linear_attention.pytorch import linear_attention_torch
from fractus.ops.linear_attention.reference import check_inputs, linear_attention_reference

__all__ = ["linear_attention", "linear_attention_reference", "linear_attention_torch", "linear_attention_triton"]


def linear_attention(q, k, v, level_weights, omegas, decay=None, state=None, eps=1e-6,
                     backend="auto", normalize=True, resets=None):
    """Multi-level causal linear attention (see the module docstring).

    q, k, v [B, T, H, D]; level_weights [Lv]; omegas Lv floats; decay None, [H] or [Lv, H];
    or one per position [B, T, H] / [B, T, Lv, H];
    state None or (S [B, Lv, H, D, D], z [B, Lv, H, D]); ``normalize=False`` leaves out the
    denominator (y_l = f_l(q)ᵀ S; z is still carried); resets None or [B, T] bool: where True the
    state is zeroed before that position (a document starts there). Returns (o [B, T, H, D] in q's dtype,
    (S, z) fp32 after the last position); differentiable in q, k, v, level_weights and state,
    and in decay: a decay per position on every path, a fixed one on the reference path only.
    """
    path = _backend.pick(backend, q)
    if path == "reference":
        return linear_attention_reference(q, k, v, level_weights, omegas, decay, state, eps, normalize, resets)
    check_inputs(q, k, v, level_weights, omegas, decay, state, resets)
    per_position = decay is not None and decay.dim() > 2
    if decay is not None and not per_position and decay.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"the {path} path of linear_attention has no gradient for decay: pass a "
                         "decay that does not require grad (a buffer, or decay.detach()), or use "
                         "backend='reference'")
    omegas = [float(om) for om in omegas]
    if path == "triton":
        if resets is not None:
            raise ValueError("the Triton linear attention has no resets (eot_reset): use backend='torch'")
        return linear_attention_triton(q, k, v, level_weights, omegas, decay, state, eps, normalize)
    return linear_attention_torch(q, k, v, level_weights, omegas, decay, state, eps, normalize, resets)
