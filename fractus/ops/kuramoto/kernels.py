"""The Kuramoto clock's Triton kernels and their autograd Function, per block of rows in registers:
the forward is one launch that keeps θ at each step boundary; the backward one launch that
recomputes each step's stages from there and writes per-program partial sums of ∂ω and ∂K (no
atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend
from fractus.ops.kuramoto.pytorch import coupling, coupling_grads

__all__ = ["kuramoto_phase_triton"]


@triton.jit
def _tile_rate(x, K, omega, damping):
    """The rate at x [BM, BN] and what its VJP needs: (k, sin x, cos x, sin x·K, cos x·K).
    Padded columns (x = 0, ω = 0, zero rows and columns of K) have rate 0 and stay at 0."""
    s, c = tl.sin(x), tl.cos(x)
    Ks = tl.dot(s, K, input_precision="ieee")
    Kc = tl.dot(c, K, input_precision="ieee")
    return omega[None, :] - damping * x + c * Ks - s * Kc, s, c, Ks, Kc


@triton.jit
def _tile_wrap(x):
    """x mod 2π in [0, 2π), as torch.remainder (fmod, then shift negative results)."""
    r = x % 6.283185307179586
    return tl.where(r < 0, r + 6.283185307179586, r)


@triton.jit
def _tile_rk4_step(theta, K, omega, dt, damping):
    """One RK4 step of θ [BM, BN], wrapped to [0, 2π)."""
    k1, _, _, _, _ = _tile_rate(theta, K, omega, damping)
    k2, _, _, _, _ = _tile_rate(theta + 0.5 * dt * k1, K, omega, damping)
    k3, _, _, _, _ = _tile_rate(theta + 0.5 * dt * k2, K, omega, damping)
    k4, _, _, _, _ = _tile_rate(theta + dt * k3, K, omega, damping)
    return _tile_wrap(theta + (dt / 6) * k1 + (dt / 3) * k2 + (dt / 3) * k3 + (dt / 6) * k4)


@triton.jit
def _tile_rate_vjp(ak, x, K, omega, damping, G, g_omega):
    """Adjoint ak [BM, BN] of the rate at x → (adjoint of x, G + ∂K, g_omega + ∂ω)."""
    _, s, c, Ks, Kc = _tile_rate(x, K, omega, damping)
    ac, as_ = ak * c, ak * s
    v = (tl.dot(ac, K, input_precision="ieee") * c + tl.dot(as_, K, input_precision="ieee") * s
         - ak * (s * Ks + c * Kc) - damping * ak)
    G += tl.dot(tl.trans(ac), s, input_precision="ieee") - tl.dot(tl.trans(as_), c, input_precision="ieee")
    return v, G, g_omega + tl.sum(ak, 0)


@triton.jit
def _tile_rk4_step_vjp(theta, a, K, omega, dt, damping, G, g_omega):
    """Adjoint a of one RK4 step's output → adjoint of its input θ. Only the stage inputs
    x2..x4 are kept; each stage's sin, cos and K products are recomputed in its VJP."""
    k1, _, _, _, _ = _tile_rate(theta, K, omega, damping)
    x2 = theta + 0.5 * dt * k1
    k2, _, _, _, _ = _tile_rate(x2, K, omega, damping)
    x3 = theta + 0.5 * dt * k2
    k3, _, _, _, _ = _tile_rate(x3, K, omega, damping)
    x4 = theta + dt * k3
    v, G, g_omega = _tile_rate_vjp(a * (dt / 6), x4, K, omega, damping, G, g_omega)
    a_theta = a + v
    v, G, g_omega = _tile_rate_vjp(v * dt + a * (dt / 3), x3, K, omega, damping, G, g_omega)
    a_theta += v
    v, G, g_omega = _tile_rate_vjp(v * (0.5 * dt) + a * (dt / 3), x2, K, omega, damping, G, g_omega)
    a_theta += v
    v, G, g_omega = _tile_rate_vjp(v * (0.5 * dt) + a * (dt / 6), theta, K, omega, damping, G, g_omega)
    return a_theta + v, G, g_omega


@triton.jit
def _clock_tile(omega_ptr, K_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows, the [BM, BN] offsets and mask of a row-major [M, N] array, ω [BN] and
    K [BN, BN] zero-padded."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M·N may pass 2³¹
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    omega = tl.load(omega_ptr + cols, mask=cols < N, other=0.0)
    K = tl.load(K_ptr + cols[:, None] * N + cols[None, :], mask=(cols[:, None] < N) & (cols[None, :] < N),
                other=0.0)
    return rows, rows[:, None] * N + cols[None, :], mask, omega, K


@triton.jit
def _kuramoto_fwd_kernel(THETA0, OMEGA, K_ptr, THETAS, XY, M, N, dt, damping, STEPS: tl.constexpr,
                         SAVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """θ⁰ [M, N] → XY [2, M] (Σ cos θ, Σ sin θ of the final θ); SAVE: θ at every step boundary
    into THETAS [STEPS + 1, M, N]."""
    rows, offs, mask, omega, K = _clock_tile(OMEGA, K_ptr, M, N, BLOCK_M, BLOCK_N)
    MN = tl.cast(M, tl.int64) * N
    theta = tl.load(THETA0 + offs, mask=mask, other=0.0).to(tl.float32)
    for step in tl.static_range(STEPS):
        if SAVE:
            tl.store(THETAS + step * MN + offs, theta, mask=mask)
        theta = _tile_rk4_step(theta, K, omega, dt, damping)
    if SAVE:
        tl.store(THETAS + STEPS * MN + offs, theta, mask=mask)
    tl.store(XY + rows, tl.sum(tl.where(mask, tl.cos(theta), 0.0), 1), mask=rows < M)
    tl.store(XY + M + rows, tl.sum(tl.where(mask, tl.sin(theta), 0.0), 1), mask=rows < M)


@triton.jit
def _kuramoto_bwd_kernel(THETAS, XY, G_PSI, OMEGA, K_ptr, DTHETA0, DOMEGA_P, DK_P, M, N, dt, damping,
                         STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """∂L/∂ψ [M] → ∂θ⁰ [M, N] and this program's partial sums ∂ω [BN] and ∂K [BN, BN]."""
    rows, offs, mask, omega, K = _clock_tile(OMEGA, K_ptr, M, N, BLOCK_M, BLOCK_N)
    MN = tl.cast(M, tl.int64) * N
    theta = tl.load(THETAS + STEPS * MN + offs, mask=mask, other=0.0)
    X = tl.load(XY + rows, mask=rows < M, other=1.0)
    Y = tl.load(XY + M + rows, mask=rows < M, other=0.0)
    dpsi = tl.load(G_PSI + rows, mask=rows < M, other=0.0).to(tl.float32)
    # ψ = atan2(Y, X): ∂ψ/∂θ_i = (X cos θ_i + Y sin θ_i) / (X² + Y²); the wrap's derivative is 1
    a = (X[:, None] * tl.cos(theta) + Y[:, None] * tl.sin(theta)) * (dpsi / (X * X + Y * Y))[:, None]
    a = tl.where(mask, a, 0.0)
    G = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
    g_omega = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(STEPS):
        theta = tl.load(THETAS + (STEPS - 1 - i) * MN + offs, mask=mask, other=0.0)
        a, G, g_omega = _tile_rk4_step_vjp(theta, a, K, omega, dt, damping, G, g_omega)
    tl.store(DTHETA0 + offs, a, mask=mask)
    cols = tl.arange(0, BLOCK_N)
    pid = tl.program_id(0).to(tl.int64)
    tl.store(DOMEGA_P + pid * BLOCK_N + cols, g_omega)
    tl.store(DK_P + pid * BLOCK_N * BLOCK_N + cols[:, None] * BLOCK_N + cols[None, :], G)


# Rows per program and warps: compiled for sm_90 (python -m fractus.bench aot), 16 rows on 8 warps
# spill least in the backward (hundreds of bytes per thread, where 32 rows on 4 warps spill
# kilobytes), which keeps ∂K's dots on chip.
_BLOCK_M = 16


def _blocks(N: int) -> dict:
    return dict(BLOCK_M=_BLOCK_M, BLOCK_N=max(16, triton.next_power_of_2(N)), num_warps=8)


def _clock_forward(theta0, omega, U, lam, dt, steps, damping, save: bool):
    """Forward launch: ψ [M] in fp32, (when ``save``) θ at every step boundary [steps + 1, M, N],
    Σ cos θ / Σ sin θ [2, M], and the fp32 ω and K the kernels read."""
    M, N = theta0.shape
    theta0, omega, K = theta0.contiguous(), omega.float().contiguous(), coupling(U, lam).float().contiguous()
    xy = _backend.empty(2, M, dtype=torch.float32, device=theta0.device)
    thetas = _backend.empty(steps + 1, M, N, dtype=torch.float32, device=theta0.device) if save else None
    _kuramoto_fwd_kernel[(triton.cdiv(M, _BLOCK_M),)](
        theta0, omega, K, xy if thetas is None else thetas, xy, M, N, float(dt), float(damping),
        STEPS=steps, SAVE=save, **_blocks(N))
    return torch.atan2(xy[1], xy[0]), thetas, xy, omega, K


class _KuramotoTritonFn(torch.autograd.Function):
    """θ⁰, ω, U, λ → ψ with the Triton kernels; saves θ at the step boundaries (fp32)."""

    @staticmethod
    def forward(ctx, theta0, omega, U, lam, dt, steps, damping):
        psi, thetas, xy, omega32, K = _clock_forward(theta0, omega, U, lam, dt, steps, damping, save=True)
        ctx.save_for_backward(thetas, xy, omega32, K, U, lam)
        ctx.consts = (dt, steps, damping, theta0.dtype, omega.dtype)
        return psi.to(theta0.dtype)

    @staticmethod
    @_backend.first_order_only
    def backward(ctx, g_psi):
        thetas, xy, omega, K, U, lam = ctx.saved_tensors
        dt, steps, damping, theta_dtype, omega_dtype = ctx.consts
        M, N = thetas.shape[1:]
        blocks = _blocks(N)
        n_prog, BN = triton.cdiv(M, _BLOCK_M), blocks["BLOCK_N"]
        dtheta = _backend.empty(M, N, dtype=torch.float32, device=thetas.device)
        domega_p = _backend.empty(n_prog, BN, dtype=torch.float32, device=thetas.device)
        dK_p = _backend.empty(n_prog, BN, BN, dtype=torch.float32, device=thetas.device)
        _kuramoto_bwd_kernel[(n_prog,)](thetas, xy, g_psi.contiguous(), omega, K, dtheta, domega_p, dK_p,
                                        M, N, float(dt), float(damping), STEPS=steps, **blocks)
        G = dK_p.sum(0)[:N, :N]
        g_U, g_lam = coupling_grads(G, U.float(), lam.float())
        return (dtheta.to(theta_dtype), domega_p.sum(0)[:N].to(omega_dtype), g_U.to(U.dtype),
                g_lam.to(lam.dtype), None, None, None)


def kuramoto_phase_triton(theta0, omega, U, lam, dt: float, steps: int, damping: float):
    """θ⁰ [M, N] fp32 → ψ [M] on the Triton path (checked arguments): the Function when a gradient
    is needed, the forward launch alone (nothing kept) otherwise."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (theta0, omega, U, lam)):
        return _KuramotoTritonFn.apply(theta0, omega, U, lam, dt, steps, damping)
    return _clock_forward(theta0, omega, U, lam, dt, steps, damping, save=False)[0].to(theta0.dtype)
