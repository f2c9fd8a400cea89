"""The sparse experts' reference, a per-token loop in fp32 straight from the definition in
:mod:`fractus.ops.moe`, and the argument checks every path shares (the expert kind from the keys
present, shapes and dtypes, the ids' range).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DENSE_KEYS", "LOWRANK_KEYS", "check_inputs", "check_range", "is_lowrank", "moe_reference"]

LOWRANK_KEYS = ("V1", "U1", "b1", "s1", "V2", "U2", "b2", "s2")
DENSE_KEYS = ("W1", "b1", "W2", "b2")


def is_lowrank(experts: dict) -> bool:
    """Whether ``experts`` holds low-rank experts (else dense); KeyError when neither key set is complete."""
    if all(k in experts for k in LOWRANK_KEYS):
        return True
    if all(k in experts for k in DENSE_KEYS):
        return False
    raise KeyError(f"experts need keys {LOWRANK_KEYS} (low-rank) or {DENSE_KEYS} (dense), "
                   f"got {sorted(experts)}")


_LAYOUT = dict(V1="[E, d, r]", U1="[E, F, r]", b1="[E, F]", s1="[E]", V2="[E, F, r]", U2="[E, d, r]",
               b2="[E, d]", s2="[E]", W1="[E, d, F]", W2="[E, F, d]")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_range(lo: int, hi: int, E: int) -> None:
    """ValueError unless the ids' range [lo, hi] lies in [0, E)."""
    if lo < 0 or hi >= E:
        raise ValueError(f"idx must lie in [0, E={E}), got values in [{lo}, {hi}]")


def check_inputs(x, idx, w, experts, bounds: bool) -> bool:
    """Validate moe's arguments (shapes and dtypes; E, F, r read from b1 and U1); returns whether
    the experts are low-rank. ``bounds``: also check idx ∈ [0, E) with one aminmax, a host sync
    on a GPU (see :func:`fractus.ops.moe.moe` for when it is done)."""
    lowrank = is_lowrank(experts)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, d], got {tuple(x.shape)}")
    N, d = x.shape
    if idx.dim() != 2 or idx.shape[0] != N:
        raise ValueError(f"idx must be [N, K] with N={N} (x's rows), got {tuple(idx.shape)}")
    if idx.shape[1] == 0:
        raise ValueError("idx has K = 0 experts per token: give K ≥ 1 (with none, y is 0 for every token)")
    if w.shape != idx.shape:
        raise ValueError(f"w must be [N, K]={tuple(idx.shape)} like idx, got {tuple(w.shape)}")
    if not x.is_floating_point() or not w.is_floating_point() or idx.dtype not in _INT_DTYPES:
        raise TypeError(f"x and w must be floating and idx integer, got x {x.dtype}, w {w.dtype}, "
                        f"idx {idx.dtype}")
    b1, U1 = experts["b1"], experts.get("U1")
    if b1.dim() != 2:
        raise ValueError(f"experts['b1'] must be [E, F], got {tuple(b1.shape)}")
    (E, F), r = b1.shape, (U1.shape[-1] if lowrank and U1.dim() == 3 else None)
    dims = dict(E=E, d=d, F=F, r=r)
    for k in LOWRANK_KEYS if lowrank else DENSE_KEYS:
        t, want = experts[k], tuple(dims[c] for c in _LAYOUT[k].strip("[]").split(", "))
        if tuple(t.shape) != want:
            raise ValueError(f"experts[{k!r}] must be {_LAYOUT[k]}={want} (E, F from b1, d from x"
                             f"{', r from U1' if lowrank else ''}), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"experts[{k!r}] must be floating, got {t.dtype}")
    if bounds and idx.numel():
        check_range(*torch.stack(torch.aminmax(idx)).tolist(), E)
    return lowrank


def _expert(m: torch.Tensor, e: int, ex: dict, lowrank: bool) -> torch.Tensor:
    """f_e(m) for rows m [M, d] → [M, d], straight from the definition."""
    if lowrank:
        h = F.gelu(ex["s1"][e] * ((m @ ex["V1"][e]) @ ex["U1"][e].t()) + ex["b1"][e])
        return ex["s2"][e] * ((h @ ex["V2"][e]) @ ex["U2"][e].t()) + ex["b2"][e]
    return F.gelu(m @ ex["W1"][e] + ex["b1"][e]) @ ex["W2"][e] + ex["b2"][e]


def moe_reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                  experts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token fp32 loop: y[n] = Σ_k w[n,k] f_{idx[n,k]}(x[n]); x [N, d] → [N, d] in x's dtype."""
    lowrank = check_inputs(x, idx, w, experts, bounds=True)  # the loop syncs per element anyway
    ex = {k: v.float() for k, v in experts.items()}
    x32, w32 = x.float(), w.float()
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x32[0])
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            acc = acc + w32[n, k] * _expert(x32[n:n + 1], e, ex, lowrank)[0]
        rows.append(acc)
    if not rows:  # no tokens: an empty y that backward still runs through
        return (0.0 * x32).to(x.dtype)
    return torch.stack(rows).to(x.dtype)
