"""The sparse experts' PyTorch path, the CPU's: (token, slot) pairs sorted by expert, each expert run
once on its contiguous rows; plain autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fractus.ops.moe.reference import check_range, is_lowrank

__all__ = ["moe_torch"]

DENSE_TOKENS = 16  # up to this many tokens (decoding's) every expert reads every token: a few
# batched matmuls instead of a sort, a host sync per expert and a loop, for E/K times the FLOPs of so
# few tokens — when that is at most DENSE_EXPERTS_PER_SLOT (palier0/1's 4 and 8 experts of top-2; not
# 1b's 128, where the sorted path's few experts cost less than every expert's matmuls)
DENSE_EXPERTS_PER_SLOT = 4


def moe_torch(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
              experts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sorted dispatch: (token, slot) pairs sorted by expert, each expert run once on its
    contiguous rows (gate folded into its last matmul), index-added back; the output bias
    term Σ_k w[n,k] b2[idx[n,k]] is one [N, E] × [E, d] matmul. x [N, d] → [N, d] in x's dtype."""
    lowrank = is_lowrank(experts)
    ex = {k: v.to(x.dtype) for k, v in experts.items()}
    E = ex["b1"].shape[0]
    N, K = idx.shape
    if 0 < N <= DENSE_TOKENS and E <= DENSE_EXPERTS_PER_SLOT * K:
        return _every_expert(x, idx, w.to(x.dtype), ex, lowrank)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = [0] * E
    if flat.numel():  # idx ∈ [0, E) checked in this path's one host sync, the counts' .tolist()
        lo, hi, *counts = torch.cat([torch.stack(torch.aminmax(flat)),
                                     torch.bincount(flat.clamp(0, E - 1), minlength=E)]).tolist()
        check_range(lo, hi, E)
    wd = w.to(x.dtype)
    xs = x.index_select(0, tok).split(counts)
    rws = wd.reshape(-1)[order].unsqueeze(1).split(counts)
    toks = tok.split(counts)
    per = {k: v.unbind(0) for k, v in ex.items() if k != "b2"}  # one stack in backward, no per-expert zero fill
    y = torch.zeros(N, E, dtype=x.dtype, device=x.device).scatter_add(1, idx, wd) @ ex["b2"]
    for e, c in enumerate(counts):
        if not c:
            continue
        m, rw = xs[e], rws[e]
        if lowrank:
            h = F.gelu(torch.addmm(per["b1"][e], (m @ per["V1"][e]) * per["s1"][e], per["U1"][e].t()))
            out = ((h @ per["V2"][e]) * (per["s2"][e] * rw)) @ per["U2"][e].t()
        else:
            out = (F.gelu(torch.addmm(per["b1"][e], m, per["W1"][e])) * rw) @ per["W2"][e]
        y = y.index_add_(0, toks[e], out)
    return y


def _every_expert(x, idx, wd, ex, lowrank):
    """Σ_k w[n,k] f_{idx[n,k]}(x_n) as Σ_e g[n,e] f_e(x_n), g the gates scattered over the experts
    (zero where not chosen): every expert on every token, batched over the experts."""
    if not torch.compiler.is_compiling():  # a host sync: in a compiled graph, inductor's own bounds checks
        lo, hi = torch.stack(torch.aminmax(idx.reshape(-1))).tolist()
        check_range(lo, hi, ex["b1"].shape[0])
    g = torch.zeros(x.shape[0], ex["b1"].shape[0], dtype=x.dtype, device=x.device).scatter_add(1, idx, wd)  # [N, E]
    if lowrank:
        h = F.gelu(torch.baddbmm(ex["b1"][:, None], (x @ ex["V1"]) * ex["s1"][:, None, None],
                                 ex["U1"].transpose(1, 2)))  # [E, N, F]
        out = ((h @ ex["V2"]) * ex["s2"][:, None, None]) @ ex["U2"].transpose(1, 2)  # [E, N, d]
    else:
        out = F.gelu(torch.baddbmm(ex["b1"][:, None], x.expand(ex["W1"].shape[0], *x.shape), ex["W1"])) @ ex["W2"]
    return torch.einsum("ne,end->nd", g, out) + g @ ex["b2"]
