"""The fused head's reference, ``F.linear`` and ``log_softmax`` in fp32 (the [N, V] logits
materialised), and the argument checks and loss reduction every path shares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_inputs", "linear_cross_entropy_reference", "reduce_loss", "scored_targets"]


def check_inputs(h, weight, targets, positions, reduction, softcap):
    """Validate shapes/arguments; targets outside [0, V) other than ignore_index are checked later."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be [N, d] and weight [V, d], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if targets.shape != (h.shape[0],):
        raise ValueError(f"targets must be [N]={h.shape[0]}, got {tuple(targets.shape)}")
    for name, t in (("targets", targets), ("positions", positions)):
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"{name} must hold integer token indices, got {t.dtype}"
                            + (" (a mask: pass mask.nonzero()[:, 0])" if t.dtype == torch.bool else ""))
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
    if positions is not None:
        if positions.dim() != 1:
            raise ValueError(f"positions must be [M], got {tuple(positions.shape)}")
        if positions.numel():
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()  # one device sync
            if lo < 0 or hi >= h.shape[0]:
                raise ValueError(f"positions must lie in [0, {h.shape[0]}), got range [{lo}, {hi}]")


def scored_targets(targets, positions, ignore_index, V):
    """Targets of the scored rows [M]; raises ValueError on a target outside [0, V) (one aminmax)."""
    t = targets if positions is None else targets[positions]
    if t.numel():
        lo, hi = torch.stack(torch.aminmax(torch.where(t == ignore_index, torch.zeros_like(t), t))).tolist()
        if lo < 0 or hi >= V:
            raise ValueError(f"targets must lie in [0, {V}) or equal ignore_index={ignore_index}; "
                             f"got a target in [{lo}, {hi}]")
    return t


def reduce_loss(ce, lse, valid, reduction, z_loss):
    """Scalar fp32 loss from per-row ce [M], lse [M] and the non-ignored mask [M]."""
    rows = ce + z_loss * lse * lse * valid if z_loss else ce
    loss = rows.sum()
    if reduction == "mean":
        loss = loss / valid.sum().clamp_min(1)
    return loss


def linear_cross_entropy_reference(h, weight, targets, *, ignore_index=-100, reduction="mean",
                                   z_loss=0.0, softcap=None, positions=None, return_per_token=False):
    """F.linear + log_softmax in fp32. Returns loss (fp32 scalar) or (loss, per-token ce [M or N])."""
    check_inputs(h, weight, targets, positions, reduction, softcap)
    t = scored_targets(targets, positions, ignore_index, weight.shape[0])
    x = h if positions is None else h[positions]
    logits = F.linear(x.float(), weight.float())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))
    ce = -logp.gather(1, safe[:, None])[:, 0] * valid
    loss = reduce_loss(ce, lse, valid, reduction, z_loss)
    return (loss, ce.detach()) if return_per_token else loss
