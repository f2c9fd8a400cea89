"""The fused head's chunked PyTorch path, the CPU's: per token chunk the logits, lse, CE and their
gradients, computed in the forward; nothing [chunk, V] survives its chunk.
"""
from __future__ import annotations

import torch

from fractus.ops import common as _backend
from fractus.ops.cross_entropy.reference import reduce_loss

__all__ = ["CHUNK_ELEMS", "linear_cross_entropy_torch"]

CHUNK_ELEMS = 1 << 24  # logits elements per chunk (64 MiB fp32)


def _chunk_rows(V: int) -> int:
    """Token rows per chunk: about CHUNK_ELEMS logits, 16 to 1024 rows. Big chunks make big
    matmuls, which run at a higher rate than several small ones."""
    return max(16, min(1024, CHUNK_ELEMS // V))


class _ChunkedLCE(torch.autograd.Function):
    """Per token chunk: logits, lse, ce and (softmax − one-hot)·scale → dH rows, dW += ; nothing
    [chunk, V] survives the chunk. Logits are laid out [V, chunk] (W·xᵀ), which makes all three
    matmuls run at full speed. Backward only scales the stored grads by grad_output, in place."""

    @staticmethod
    def forward(ctx, h, weight, t, positions, ignore_index, reduction, z_loss, softcap, grad_enabled):
        need_h, need_w = (grad_enabled and n for n in ctx.needs_input_grad[:2])  # none under no_grad
        N, d = h.shape
        V = weight.shape[0]
        M = t.shape[0]
        W = weight.detach().float()
        valid = t != ignore_index
        safe = torch.where(valid, t, torch.zeros_like(t))
        n_valid = int(valid.sum())
        scale = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
        f32 = dict(dtype=torch.float32, device=h.device)
        lse = _backend.empty(M, **f32)
        ce = _backend.empty(M, **f32)
        dH = _backend.empty(M, d, **f32) if need_h else None
        dW = (_backend.empty(V, d, **f32) if M else torch.zeros(V, d, **f32)) if need_w else None
        C = _chunk_rows(V)
        buf = torch.empty(V * min(C, M), **f32)
        dbuf = torch.empty_like(buf) if softcap is not None and (need_h or need_w) else None
        for s in range(0, M, C):
            e = min(s + C, M)
            n = e - s
            x = h.detach()[s:e] if positions is None else h.detach()[positions[s:e]]
            x = x.float()
            lg = torch.mm(W, x.t(), out=buf[:V * n].view(V, n))  # [V, n]
            if softcap is not None:
                lg.div_(softcap).tanh_()
                if dbuf is not None:
                    dcap = torch.mul(lg, lg, out=dbuf[:V * n].view(V, n)).neg_().add_(1.0)  # 1 − tanh²
                lg.mul_(softcap)
            ts, vs = safe[None, s:e], valid[s:e]
            tgt = lg.gather(0, ts)[0]
            m = lg.amax(0)
            lg.sub_(m).exp_()
            ssum = lg.sum(0)
            l = m + ssum.log()
            lse[s:e] = l
            ce[s:e] = (l - tgt) * vs
            if need_h or need_w:
                a = vs.float() * scale
                coef = a * (1.0 + 2.0 * z_loss * l) / ssum if z_loss else a / ssum
                lg.mul_(coef)
                lg.scatter_add_(0, ts, -a[None])
                if dbuf is not None:
                    lg.mul_(dcap)
                if need_h:
                    torch.mm(lg.t(), W, out=dH[s:e])
                if need_w and s:
                    dW.addmm_(lg, x)
                elif need_w:
                    torch.mm(lg, x, out=dW)
        del buf, dbuf
        if need_h:
            if positions is not None:
                dH = torch.zeros(N, d, **f32).index_add_(0, positions, dH)
            dH = dH.to(h.dtype)
        if need_w:
            dW = dW.to(weight.dtype)
        ctx.grads = (dH, dW)  # not saved tensors: backward scales them in place and lets go
        loss = reduce_loss(ce, lse, valid, reduction, z_loss)
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, g_loss, g_ce):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy's CPU path computes its gradients in the forward and "
                               "hands them over once: backward through it twice (retain_graph) is not supported")
        (dH, dW), ctx.grads = ctx.grads, None
        scale = float(g_loss)
        if scale != 1.0:
            dH = dH.mul_(scale) if dH is not None else None
            dW = dW.mul_(scale) if dW is not None else None
        return dH, dW, None, None, None, None, None, None, None


def linear_cross_entropy_torch(h, weight, t, positions, ignore_index, reduction, z_loss, softcap):
    """(loss, per-token ce) of the scored rows on the chunked path (checked arguments: targets ``t``
    [M] of the scored rows, ``positions`` contiguous or None); the gradients are computed now when
    grad mode is on."""
    return _ChunkedLCE.apply(h, weight, t, positions, ignore_index, reduction, z_loss, softcap,
                             torch.is_grad_enabled())
