"""The Kuramoto clock's reference: the RK4 steps of :mod:`fractus.ops.kuramoto` as written, with
plain autograd.
"""
from __future__ import annotations

import math

import torch

__all__ = ["TWO_PI", "kuramoto_phase_reference"]

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
