"""Kuramoto phase clock: RK4 integration of N coupled oscillators per token, then the mean angle.

Shapes: θ⁰ [M, N] initial phases (one row per token), ω [N] natural frequencies, U [N, r] and
λ [r] the low-rank coupling K = U diag(λ) Uᵀ. The rate is
    dθ/dt = ω − damping·θ + cos θ ⊙ (K sin θ) − sin θ ⊙ (K cos θ),
(Σ_j K_ij sin(θ_j − θ_i) expanded), integrated with ``steps`` RK4 steps of size dt, wrapped to
[0, 2π) after each step; the output is ψ = atan2(Σ sin θ, Σ cos θ) [M].

The paths, one module each: :mod:`.reference` (plain autograd, the math as written);
:mod:`.pytorch`, a ``torch.autograd.Function`` whose forward keeps no autograd graph and whose
backward is the exact reverse of the RK4 steps written by hand (the vector-Jacobian product of the
rate); and :mod:`.kernels`, Triton kernels doing the same per block of rows in registers. Written
as PyTorch ops the clock is ~200 tiny launches per block (forward + backward); on a CPU their
autograd bookkeeping costs more than the math, on a GPU each is a kernel launch. The Triton forward
is one launch (it keeps θ at each step boundary); its backward is one launch that recomputes each
step's stages from there and writes per-program partial sums of ∂ω and ∂K (no atomics).
:func:`kuramoto_phase` dispatches through :func:`fractus.ops.common.pick`: Triton on CUDA, the
fused PyTorch path on CPU.
"""
from __future__ import annotations

import math
import numbers

import torch

from fractus.ops import common as _backend
from fractus.ops.kuramoto.kernels import kuramoto_phase_triton
from fractus.ops.kuramoto.pytorch import kuramoto_phase_torch
from fractus.ops.kuramoto.reference import kuramoto_phase_reference

__all__ = ["kuramoto_phase", "kuramoto_phase_reference", "kuramoto_phase_torch", "kuramoto_phase_triton"]


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
    if path == "triton":
        return kuramoto_phase_triton(theta0, omega, U, lam, dt, steps, damping)
    return kuramoto_phase_torch(theta0, omega, U, lam, dt, steps, damping)
