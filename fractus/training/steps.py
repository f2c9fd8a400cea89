"""The parts of a training step that the trainer, the benchmarks and the vision trainer share:
bf16 :func:`autocast`, :func:`micro_steps` (forward and backward over an optimizer step's
micro-batches, the carried state detached between them), PGSU's :func:`set_active_blocks`, and the
RNG state a checkpoint keeps (:func:`rng_state`, :func:`set_rng_state`).
"""
from __future__ import annotations

import contextlib
import math

import torch

from fractus.model import FractusCTE


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on ``device``'s type if ``bf16``, else a context that changes nothing."""
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_steps(fwd, batches, state, accum: int, head_positions: str, device: torch.device, bf16: bool,
                no_sync=None):
    """Forward + backward over ``accum`` chunks of ``batches`` ((x, y, new_epoch) triples),
    carrying the detached state; gradients accumulate, scaled by 1/accum. ``no_sync``: DDP's
    ``no_sync`` (gradients are all-reduced on the last micro-step only).

    Returns (mean CE, mean lb, state, finite); with a non-finite loss the gradients are garbage
    and the caller drops them. Every micro-step runs its backward, finite or not, so that under
    DDP every rank makes the same all-reduces; the losses are read once per micro-step, after
    the backward is queued.
    """
    ce_sum, lb_sum, finite = 0.0, 0.0, True
    for i, (x, y, new_epoch) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        if new_epoch:
            state = None
        with no_sync() if no_sync is not None and i < accum - 1 else contextlib.nullcontext():
            with autocast(device, bf16):
                _, parts, state = fwd(x, state, y, head_positions)
            (parts["loss"] / accum).backward()
        state = FractusCTE.detach_state(state)
        loss, ce, lb = torch.stack([parts["loss"].detach(), parts["ce"].detach(), parts["lb"].detach()]).tolist()
        finite = finite and math.isfinite(loss)
        ce_sum, lb_sum = ce_sum + ce, lb_sum + lb
    if not finite:
        return float("nan"), float("nan"), state, False
    return ce_sum / accum, lb_sum / accum, state, True


def set_active_blocks(model: FractusCTE, k: int, seed: int, step: int) -> list[int]:
    """PGSU: only ``k`` of ``model``'s blocks, drawn from ``seed`` and ``step``, train this step
    (the others' parameters stop requiring gradients; a detached clock stays frozen); returns
    their indices."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = sorted(torch.randperm(len(model.blocks), generator=g)[:k].tolist())
    for i, blk in enumerate(model.blocks):
        blk.requires_grad_(i in active)
        if blk.clock is not None and model.cfg.detach_kuramoto:
            blk.clock.requires_grad_(False)
    return active


def rng_state() -> dict:
    """The CPU generator's state and, where CUDA is available, every device's: what a checkpoint
    keeps so that a resumed run draws what the uninterrupted one would."""
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore :func:`rng_state`'s ``st`` (its CUDA states only where CUDA is available)."""
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])

