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
The paths, one module each: :mod:`.reference` (one position at a time, and the argument checks),
:mod:`.pytorch` (the chunked WY form with plain autograd) and :mod:`.kernels` (the same chunked
form in Triton, with a hand-written backward, and a decode kernel). :func:`delta_rule` dispatches
between them through :func:`fractus.ops.common.pick`.
"""

from __future__ import annotations

from fractus.ops import common as _backend
from fractus.ops.delta_rule.kernels import delta_rule_triton
from fractus.ops.delta_rule.pytorch import delta_rule_chunked
from fractus.ops.delta_rule.reference import delta_rule_reference

__all__ = ["delta_rule", "delta_rule_chunked", "delta_rule_reference", "delta_rule_triton"]


def delta_rule(q, k, v, level_weights, omegas, beta, decay=None, state=None, resets=None, backend="auto"):
    """The gated delta rule (see the module docstring): "auto" runs Triton on CUDA tensors and the
    chunked PyTorch form on CPU tensors. Returns (o [B, T, H, D], S [B, Lv, H, D, D]);
    differentiable in q, k, v, level_weights, beta, decay and state."""
    path = _backend.pick(backend, q)
    if path == "reference":
        return delta_rule_reference(q, k, v, level_weights, omegas, beta, decay, state, resets)
    if path == "triton":
        return delta_rule_triton(q, k, v, level_weights, omegas, beta, decay, state, resets)
    return delta_rule_chunked(q, k, v, level_weights, omegas, beta, decay, state, resets)
