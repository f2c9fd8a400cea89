"""The optimiser and its learning-rate schedule: each optimizer's default peak rate (AdamW's tuned
per model family), the default warm-up, :func:`make_optimizer` (weight decay on the matrices only)
and :func:`lr_lambda` (linear warm-up, then a cosine decay to a floor). The trainer, the vision
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


def lr_lambda(warmup: int, total: int, floor: float):
    """LambdaLR's factor of the peak rate at optimizer step ``step``: (step + 1) / ``warmup`` for the
    first ``warmup`` steps, then a cosine from 1 down to ``floor`` at step ``total``, then ``floor``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return f

