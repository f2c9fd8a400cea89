"""Kuramoto phase clock: RK4 integration of N coupled oscillators per token, then the mean angle.

Shapes: θ⁰ [M, N] initial phases (one row per token), ω [N] natural frequencies, U [N, r] and
λ [r] the low-rank coupling K = U diag(λ) Uᵀ. The rate is
    dθ/dt = ω − damping·θ + cos θ ⊙ (K sin θ) − sin θ ⊙ (K cos θ),
(Σ_j K_ij sin(θ_j − θ_i) expanded), integrated with ``steps`` RK4 steps of size dt, wrapped to
[0, 2π) after each step; the output is ψ = atan2(Σ sin θ, Σ cos θ) [M].

Three paths: the reference (plain autograd, the math as written); a fused PyTorch one, a
``torch.autograd.Function`` whose forward keeps no autograd graph and whose backward is the exact
reverse of the RK4 steps written by hand (the vector-Jacobian product of the rate below); and
Triton kernels doing the same per block of rows in registers. Written as PyTorch ops the clock is
~200 tiny launches per block (forward + backward); on a CPU their autograd bookkeeping costs more
than the math, on a GPU each is a kernel launch. The Triton forward is one launch (it keeps θ at
each step boundary); its backward is one launch that recomputes each step's stages from there and
writes per-program partial sums of ∂ω and ∂K (no atomics). :func:`kuramoto_phase` dispatches
through :func:`fractus.ops.common.pick`: Triton on CUDA, the fused PyTorch path on CPU.
"""
from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from fractus.ops import common as _backend

__all__ = ["kuramoto_phase", "kuramoto_phase_reference"]

TWO_PI = 2 * math.pi


def _rate(theta, omega, U, lam, damping):
    s, c = theta.sin(), theta.cos()
    Ks = (s @ U) * lam @ U.T
    Kc = (c @ U) * lam @ U.T
    return omega - damping * theta + c * Ks - s * Kc


def kuramoto_phase_reference(theta0, omega, U, lam, dt: float, steps: int, damping: float):
    """θ⁰ [M, N] → ψ [M] with plain autograd."""
    theta = theta0
    for _ in range(steps):
        k1 = _rate(theta, omega, U, lam, damping)
        k2 = _rate(theta + 0.5 * dt * k1, omega, U, lam, damping)
        k3 = _rate(theta + 0.5 * dt * k2, omega, U, lam, damping)
        k4 = _rate(theta + dt * k3, omega, U, lam, damping)
        theta = torch.remainder(theta + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), TWO_PI)
    return torch.atan2(theta.sin().sum(-1), theta.cos().sum(-1))


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
        K = _coupling(U, lam)
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
        return a, g_omega, *_coupling_grads(G, U, lam), None, None, None


def _coupling(U, lam):
    """K = U diag(λ) Uᵀ [N, N] (symmetric)."""
    return (U * lam) @ U.T


def _coupling_grads(G, U, lam):
    """∂L/∂K [N, N] → (∂U, ∂λ) through K = U diag(λ) Uᵀ: ∂U = (G + Gᵀ) U diag(λ), ∂λ_k = (Uᵀ G U)_kk."""
    return (G + G.T) @ U * lam, ((G @ U) * U).sum(0)


# ----------------------------------------------------------------------------- Triton
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
    theta0, omega, K = theta0.contiguous(), omega.float().contiguous(), _coupling(U, lam).float().contiguous()
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
        g_U, g_lam = _coupling_grads(G, U.float(), lam.float())
        return (dtheta.to(theta_dtype), domega_p.sum(0)[:N].to(omega_dtype), g_U.to(U.dtype),
                g_lam.to(lam.dtype), None, None, None)


# ----------------------------------------------------------------------------- public
def _check(theta0, omega, U, lam, dt, steps, damping, path: str) -> None:
    """θ⁰ [M, N] fp32 (or fp64 on the PyTorch paths: phases are too fine for half precision); ω [N];
    U [N, r]; λ [r], all in θ⁰'s dtype (shapes only: no device sync); dt > 0, steps ≥ 1 and
    damping ≥ 0, finite."""
    integral = isinstance(steps, numbers.Integral) and not isinstance(steps, bool)
    if not (integral and steps >= 1 and 0 < dt < math.inf and 0 <= damping < math.inf):
        raise ValueError(f"need an integer steps ≥ 1, a finite dt > 0 and a finite damping ≥ 0; "
                         f"got steps={steps!r}, dt={dt!r}, damping={damping!r}")
    if theta0.dim() != 2 or not theta0.is_floating_point():
        raise ValueError(f"theta0 must be a floating [M, N] tensor, got {tuple(theta0.shape)} {theta0.dtype}")
    if theta0.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"theta0 must be torch.float32 (phases are too fine for half precision), got {theta0.dtype}")
    if theta0.dtype == torch.float64 and path == "triton":
        raise ValueError("theta0 must be torch.float32 on the Triton path (its kernels compute in fp32), "
                         "got torch.float64; the PyTorch paths take fp64")
    N = theta0.shape[1]
    r = lam.shape[0] if lam.dim() == 1 else -1
    for name, t, shape in (("omega", omega, (N,)), ("U", U, (N, r)), ("lam", lam, (r,))):
        if tuple(t.shape) != shape or t.dtype != theta0.dtype:
            raise ValueError(f"{name} must be {list(shape)} {theta0.dtype} for theta0 {list(theta0.shape)}, "
                             f"got {list(t.shape)} {t.dtype}")


def kuramoto_phase(theta0, omega, U, lam, dt: float, steps: int, damping: float,
                   backend: str = "auto"):
    """θ⁰ [M, N] fp32 → routing angle ψ [M] (fp64 too on the PyTorch paths). ``"auto"``: the Triton
    kernels on CUDA, the fused PyTorch path on CPU; ``"torch"``: the fused PyTorch path;
    ``"reference"``: plain autograd; ``"triton"`` on CPU: the interpreter."""
    path = _backend.pick(backend, theta0)
    _check(theta0, omega, U, lam, dt, steps, damping, path)
    steps = int(steps)
    if path == "reference":
        return kuramoto_phase_reference(theta0, omega, U, lam, dt, steps, damping)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (theta0, omega, U, lam))
    if path == "triton":
        if grad:
            return _KuramotoTritonFn.apply(theta0, omega, U, lam, dt, steps, damping)
        return _clock_forward(theta0, omega, U, lam, dt, steps, damping, save=False)[0].to(theta0.dtype)
    if grad:
        return _KuramotoFn.apply(theta0, omega, U, lam, dt, steps, damping)
    return _integrate(theta0, omega, _coupling(U, lam), dt, steps, damping, keep=False)[0]
