"""Sparse mixture of (low-rank or dense) experts: y[n] = Σ_k w[n,k] · f_{idx[n,k]}(x[n]).

Shapes: x [N, d] tokens, idx [N, K] integer expert ids in [0, E), w [N, K] gate weights.

Low-rank experts (keys V1 [E, d, r], U1 [E, F, r], b1 [E, F], s1 [E], V2 [E, F, r],
U2 [E, d, r], b2 [E, d], s2 [E]):
    f_e(m) = s2_e · (gelu(s1_e · (m V1_e) U1_eᵀ + b1_e) V2_e) U2_eᵀ + b2_e
Dense experts (keys W1 [E, d, F], b1 [E, F], W2 [E, F, d], b2 [E, d]):
    f_e(m) = gelu(m W1_e + b1_e) W2_e + b2_e
gelu is the exact erf gelu. The expert kind is chosen by which keys are present.

The experts may be in a wider dtype than x (fp32 masters under autocast): the sorted PyTorch and
Triton paths compute in x's dtype with fp32 accumulation (the reference in fp32), and the Triton
kernels cast each weight tile as they load it, so no step copies all E experts and their
gradients come back fp32.

The paths, one module each: :mod:`.reference` (the per-token fp32 loop, and the argument checks),
:mod:`.pytorch` (sorted by expert) and :mod:`.kernels` (routing on the device, fused low-rank and
grouped-GEMM dense kernels). :func:`moe` dispatches between them through
:func:`fractus.ops.common.pick`.
"""
from __future__ import annotations

import torch

from fractus.ops import common as _backend
from fractus.ops.moe.kernels import moe_triton
from fractus.ops.moe.pytorch import moe_torch
from fractus.ops.moe.reference import DENSE_KEYS, LOWRANK_KEYS, check_inputs, moe_reference

__all__ = ["DENSE_KEYS", "LOWRANK_KEYS", "moe", "moe_reference", "moe_torch", "moe_triton"]


def moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: dict[str, torch.Tensor],
        backend: str = "auto") -> torch.Tensor:
    """Sparse MoE: y[n] = Σ_k w[n,k] f_{idx[n,k]}(x[n]) → y [N, d] in x's dtype.

    x [N, d] floating (fp32/fp16/bf16 on the Triton path, which raises TypeError otherwise);
    idx [N, K] any integer dtype, expert ids in [0, E); w [N, K] floating; experts: the low-rank
    or dense dict of the module docstring, any floating dtype, every shape consistent with E and
    F (from b1), d (from x) and r (from U1). Raises ValueError naming the argument on a bad shape
    or id, TypeError on a bad dtype, KeyError on missing expert keys.

    The id range is checked by the reference and torch paths, and by the Triton path only for CPU
    ids (the interpreter): on a GPU that path never syncs with the host (its routing is built on
    the device) and a check would add a sync per call, so ids outside [0, E) are undefined there.
    """
    which = _backend.pick(backend, x)
    if which == "reference":
        return moe_reference(x, idx, w, experts)
    # torch: the range check is folded into moe_torch's own host sync (its per-expert counts)
    check_inputs(x, idx, w, experts, bounds=which == "triton" and idx.device.type == "cpu")
    idx = idx.long()
    if which == "torch":
        return moe_torch(x, idx, w, experts)
    return moe_triton(x, idx, w, experts)
