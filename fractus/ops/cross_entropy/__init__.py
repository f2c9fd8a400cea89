"""Fused tied-head linear + cross-entropy: loss(h·Wᵀ, targets) without the [N, V] logits.

Shapes: h [N, d] final hidden states, weight [V, d] (the tied embedding), targets [N] int64,
positions [M] int64 (optional: only those rows are scored). Logits are h·Wᵀ accumulated in fp32,
optionally soft-capped (cap·tanh(logit/cap)); per-token ce = lse − logit[target]; rows whose
target is ``ignore_index`` give 0 and leave the mean; z_loss adds z·lse² per non-ignored scored
row to the loss (not to the returned per-token CE, which is a detached metric).

The paths, one module each: :mod:`.reference` (fp32, the logits materialised; and the argument
checks), :mod:`.pytorch` (chunked, gradients computed in the forward chunk by chunk) and
:mod:`.kernels` (Triton: online log-sum-exp forward; backward recomputes logits tiles in two
kernels, one gridded over token blocks for dH and one over vocab tiles for dW, no atomics).
:func:`linear_cross_entropy` dispatches between them through :func:`fractus.ops.common.pick`.
"""
from __future__ import annotations

from fractus.ops import common as _backend
from fractus.ops.cross_entropy.kernels import linear_cross_entropy_triton
from fractus.ops.cross_entropy.pytorch import linear_cross_entropy_torch
from fractus.ops.cross_entropy.reference import check_inputs, linear_cross_entropy_reference, scored_targets

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "linear_cross_entropy_torch",
           "linear_cross_entropy_triton"]


def linear_cross_entropy(h, weight, targets, *, ignore_index=-100, reduction="mean",
                         z_loss=0.0, softcap=None, positions=None, return_per_token=False,
                         backend="auto"):
    """Cross-entropy of the tied head h·Wᵀ without materialising the [N, V] logits.

    h [N, d], weight [V, d], targets [N] int64, positions [M] int64 or None. Returns the fp32
    scalar loss, or (loss, per-token ce [M or N] fp32, 0 at ignored rows, detached).
    """
    path = _backend.pick(backend, h)
    kw = dict(ignore_index=ignore_index, reduction=reduction, z_loss=z_loss, softcap=softcap,
              positions=positions, return_per_token=return_per_token)
    if path == "reference":
        return linear_cross_entropy_reference(h, weight, targets, **kw)
    check_inputs(h, weight, targets, positions, reduction, softcap)
    positions = positions.contiguous() if positions is not None else None  # the kernels read it with stride 1
    t = scored_targets(targets, positions, ignore_index, weight.shape[0])
    args = (h, weight, t, positions, ignore_index, reduction, float(z_loss), softcap)
    if path == "triton":
        loss, ce = linear_cross_entropy_triton(*args)
    else:
        loss, ce = linear_cross_entropy_torch(*args)
    return (loss, ce) if return_per_token else loss
