"""The convergence rule every experiment shares: a run is read only once its learning curve has
settled.

A run records its curve — a held-out measure (accuracy, or validation CE) at fixed step intervals —
and has *settled* when, over the last quarter of its steps, that measure moved by no more than a
stated tolerance (the largest value minus the smallest, over the points in that quarter, the final
one included). A run that has not settled is not read: its experiment trains it again at twice the
steps (:func:`next_budget`), up to a ceiling, and the reading states the budget it was taken at.

A flat curve can also be a plateau that a longer run would leave (a task not yet learnt): the rule
cannot tell the two apart, so a reading also says where the measure stands against chance.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

LAST = 0.25  # the fraction of the run's steps the rule looks at
ACCURACY_TOL = 0.02  # recall accuracy: at most 2 points of 100 over the last quarter
CE_TOL = 0.02  # validation CE, nats/token


def change_over_last(steps: Sequence[int], values: Sequence[float], last: float = LAST) -> float:
    """How far ``values`` (measured at ``steps``, ascending, the run's final step last) moved over
    the last ``last`` of the run: max − min of the points at steps ≥ (1 − last) · final step. NaN
    with fewer than two such points (the curve is too coarse to tell) or a non-finite value."""
    if len(steps) != len(values) or not len(steps):
        raise ValueError(f"a curve needs as many steps as values, at least one: got {len(steps)} and {len(values)}")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"a curve's steps must ascend: {list(steps)}")
    start = (1 - last) * steps[-1]
    tail = [v for s, v in zip(steps, values) if s >= start]
    if len(tail) < 2 or not all(math.isfinite(v) for v in tail):
        return math.nan
    return max(tail) - min(tail)


def settled(steps: Sequence[int], values: Sequence[float], tol: float, last: float = LAST) -> bool:
    """Whether the curve moved by at most ``tol`` over its last ``last`` (:func:`change_over_last`)."""
    return change_over_last(steps, values, last) <= tol


def next_budget(steps: int, is_settled: bool, max_steps: int) -> int | None:
    """The budget to train a run at next: None once it has settled, or when twice ``steps`` would
    pass ``max_steps`` (the reading then says the run had not settled)."""
    return None if is_settled or 2 * steps > max_steps else 2 * steps
