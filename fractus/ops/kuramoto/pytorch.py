"""The Kuramoto clock's fused PyTorch path, the CPU's: an autograd Function whose forward keeps no
graph (only each stage's sin, cos, K sin, K cos) and whose backward is the exact reverse of the RK4
steps, written by hand (the vector-Jacobian product of the rate). As plain autograd the clock is
~200 tiny ops per block, whose bookkeeping costs more than the math on a CPU.
"""
from __future__ import annotations

import torch

from fractus.ops import common as _backend
from fractus.ops.kuramoto.reference import TWO_PI

__all__ = ["coupling", "coupling_grads", "kuramoto_phase_torch"]

# RK4 stage i evaluates the rate at θ + STAGE_STEP[i]·dt·k_{i−1}; the step adds Σ WEIGHT[i]·dt·k_i.
_STAGE_STEP = (0.0, 0.5, 0.5, 1.0)
_WEIGHT = (1 / 6, 1 / 3, 1 / 3, 1 / 6)


def _integrate(theta, omega, K, dt, steps, damping, keep):
    """Forward without a graph. K [N, N] dense (symmetric). Returns (ψ [M], final θ, per-stage
    (sin, cos, K sin, K cos) when ``keep``)."""
    stages = []
    for _ in range(steps):
        acc, k = theta, None
        for step, weight in zip(_STAGE_STEP, _WEIGHT):
            x = theta if k is None else torch.add(theta, k, alpha=step * dt)
            s, c = x.sin(), x.cos()
            Ks, Kc = s @ K, c @ K
            k = torch.add(omega, x, alpha=-damping).addcmul_(c, Ks).addcmul_(s, Kc, value=-1.0)
            acc = torch.add(acc, k, alpha=weight * dt)
            if keep:
                stages.append((s, c, Ks, Kc))
        theta = torch.remainder(acc, TWO_PI)
    return torch.atan2(theta.sin().sum(-1), theta.cos().sum(-1)), theta, stages


class _KuramotoFn(torch.autograd.Function):
    """θ⁰, ω, U, λ → ψ. Forward saves each stage's (sin, cos, K·sin, K·cos) [M, N]; backward
    runs the RK4 steps in reverse with the rate's vector-Jacobian product."""

    @staticmethod
    def forward(ctx, theta0, omega, U, lam, dt, steps, damping):
        K = coupling(U, lam)
        psi, theta, stages = _integrate(theta0, omega, K, dt, steps, damping, keep=True)
        ctx.save_for_backward(U, lam, K, theta, *(t for st in stages for t in st))
        ctx.consts = (dt, steps, damping)
        return psi

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, g_psi):
        U, lam, K, theta, *flat = ctx.saved_tensors
        dt, steps, damping = ctx.consts
        stages = [flat[i:i + 4] for i in range(0, len(flat), 4)]
        # ψ = atan2(Y, X), Y = Σ sin θ, X = Σ cos θ  →  ∂ψ/∂θ_i = (X cos θ_i + Y sin θ_i) / (X² + Y²)
        s, c = theta.sin(), theta.cos()
        Y, X = s.sum(-1, keepdim=True), c.sum(-1, keepdim=True)
        a = (X * c + Y * s) * (g_psi[:, None] / (X * X + Y * Y))  # adjoint of θ (remainder: ∂ = 1)
        g_omega = theta.new_zeros(theta.shape[1])
        G = torch.zeros_like(K)  # ∂L/∂K
        for step_i in reversed(range(steps)):
            st = stages[4 * step_i:4 * step_i + 4]
            a_theta, a_k = a, None  # a_k: adjoint flowing into k_{i} from stage i+1's input
            for i in reversed(range(4)):
                s, c, Ks, Kc = st[i]
                ak = a * (_WEIGHT[i] * dt) if a_k is None else torch.add(a_k, a, alpha=_WEIGHT[i] * dt)
                # vector-Jacobian product of the rate at this stage's input x
                ac, as_ = ak * c, ak * s
                v = (ac @ K).mul_(c).addcmul_(as_ @ K, s).addcmul_(ak, s * Ks + c * Kc, value=-1.0)
                v.add_(ak, alpha=-damping)
                g_omega += ak.sum(0)
                G.addmm_(ac.T, s).addmm_(as_.T, c, alpha=-1.0)
                a_theta = a_theta + v
                a_k = v * (_STAGE_STEP[i] * dt) if i else None
            a = a_theta
        return a, g_omega, *coupling_grads(G, U, lam), None, None, None


def coupling(U, lam):
    """K = U diag(λ) Uᵀ [N, N] (symmetric)."""
    return (U * lam) @ U.T


def coupling_grads(G, U, lam):
    """∂L/∂K [N, N] → (∂U, ∂λ) through K = U diag(λ) Uᵀ: ∂U = (G + Gᵀ) U diag(λ), ∂λ_k = (Uᵀ G U)_kk."""
    return (G + G.T) @ U * lam, ((G @ U) * U).sum(0)


def kuramoto_phase_torch(theta0, omega, U, lam, dt: float, steps: int, damping: float):
    """θ⁰ [M, N] → ψ [M] on the fused path (checked arguments): the Function when a gradient is
    needed, the forward alone otherwise."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (theta0, omega, U, lam)):
        return _KuramotoFn.apply(theta0, omega, U, lam, dt, steps, damping)
    return _integrate(theta0, omega, coupling(U, lam), dt, steps, damping, keep=False)[0]
