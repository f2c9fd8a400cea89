"""The optimiser and its learning-rate schedule: each optimizer's default peak rate (AdamW's tuned
per model family), the default warm-up, :func:`make_optimizer` (weight decay on the matrices only)
and :func:`lr_lambda` (linear warm-up, then a cosine or warmup-stable-decay curve down to a floor). The trainer, the vision
trainer and the benchmarks build their optimizers with these.
"""
from __future__ import annotations

import math

import torch

# AdamW's peak learning rate per model family, each the rate of lowest mean validation CE at 3 M
# tokens (results/compare_cpu.csv): the default CTE and the Transformer++ at make demo's setting, the
# original architecture at its own (32 streams of 64, 50 warm-up steps)
ADAMW_LR = {"cte": 6e-3, "original": 1.5e-3, "transformer": 1.5e-3}
DEFAULT_LR = {"sgd": 0.1, "adamw": ADAMW_LR["cte"], "rmsprop": 2e-3}  # each optimizer's peak learning rate
WARMUP_FRACTION = 0.05  # the default linear warm-up: this fraction of the run's optimizer steps


def warmup_steps(warmup: int | None, total_steps: int) -> int:
    """The run's warm-up in optimizer steps: ``--warmup`` if given, else WARMUP_FRACTION of them."""
    return round(WARMUP_FRACTION * total_steps) if warmup is None else warmup


def model_family(model: str | None, preset: str) -> str:
    """"transformer", "original" (an ``original-*`` preset) or "cte"."""
    return "transformer" if model == "transformer" else "original" if preset.startswith("original-") else "cte"


def default_lr(optimizer: str, model: str | None, preset: str) -> float:
    """The peak learning rate without --lr: AdamW's tuned per model family, the others' per optimizer."""
    return ADAMW_LR[model_family(model, preset)] if optimizer == "adamw" else DEFAULT_LR[optimizer]


def make_optimizer(model, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``name`` ("sgd": momentum 0.9; "rmsprop"; else AdamW, betas (0.9, 0.95)) over ``model``'s
    parameters, ``weight_decay`` on the matrices (the embedding included), none on gains and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


LR_SHAPES = ("cosine", "wsd")  # --lr-shape: the decay after the warm-up
DECAY_FRACTION = 0.2  # wsd: the final fraction of the steps over which the rate decays


def lr_lambda(warmup: int, total: int, floor: float, shape: str = "cosine", decay_fraction: float = DECAY_FRACTION,
              offset: int = 0, span: int | None = None, decay_start: int | None = None):
    """LambdaLR's factor of the peak rate at optimizer step ``step``: a linear warm-up, (step + 1) /
    ``warmup`` for the first ``warmup`` steps, times the decay curve of ``shape`` read at step
    ``offset + step`` of a curve ``span`` steps long (default ``total``) that begins its decay after
    step ``decay_start`` (default ``warmup``):

    - ``cosine``: from 1 down to ``floor`` at the curve's end, then ``floor``;
    - ``wsd`` (warm-up, stable, decay): 1, then linearly down to ``floor`` over the last
      ``decay_fraction`` of the curve.

    A single run is the curve itself (offset 0, span its steps). A schedule whose stages share one
    curve (``--stage-lr continue``) gives each stage its steps before it as ``offset``, the whole
    schedule's as ``span`` and the first stage's warm-up as ``decay_start``; a later stage's own
    warm-up then ramps its fresh optimizer up to the curve's value where the stage starts."""
    span = total if span is None else span
    start = warmup if decay_start is None else decay_start
    if shape not in LR_SHAPES:
        raise ValueError(f"learning-rate shape {shape!r} is not one of {LR_SHAPES}")

    def curve(g: int) -> float:
        if shape == "wsd":
            first = span - decay_fraction * (span - start)  # the decay's first step
            t = 0.0 if g <= first else min(1.0, (g - first) / max(1e-9, span - first))
            return 1 - (1 - floor) * t
        t = min(1.0, max(0, g - start) / max(1, span - start))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    def f(step: int) -> float:
        ramp = (step + 1) / warmup if step < warmup else 1.0
        return ramp * curve(offset + step) if (offset or step >= warmup) else ramp
    return f
