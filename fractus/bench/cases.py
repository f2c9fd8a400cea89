"""Inputs that the GPU suite's stages and the launches :mod:`fractus.verify.aot` captures for them
share: generation's prompt and the Kuramoto clock's case."""
from __future__ import annotations

import torch

GEN_PROMPT = list(range(1, 17))  # generation's prompt (16 tokens)


def kuramoto_case(device: torch.device, small: bool):
    """θ⁰ [M, N], ω, U, λ (leaves on the device) and an upstream gradient for ψ [M], fp32."""
    M, N, r = (37, 8, 4) if small else (1 << 17, 16, 8)  # 1b: 16 oscillators, rank 8
    g = torch.Generator().manual_seed(0)
    args = [3 * torch.randn(M, N, generator=g), 0.3 * torch.randn(N, generator=g),
            torch.randn(N, r, generator=g) / N ** 0.5, 0.5 + torch.rand(r, generator=g)]
    return [a.to(device).requires_grad_() for a in args], torch.randn(M, generator=g).to(device)
