"""The convergence rule: a curve has settled when it moved by at most a tolerance over the last
quarter of its steps; a run that has not is trained again at twice the steps, up to a ceiling."""
import math

import pytest

from fractus.experiments.convergence import change_over_last, next_budget, settled


def test_the_last_quarter_decides():
    steps = [250 * i for i in range(1, 25)]  # 6,000 steps, 24 points: the last quarter is 4,500 on (7 points)
    rising = [min(1.0, s / 4000) for s in steps]  # learnt by 4,000: flat over the last quarter
    assert change_over_last(steps, rising) == 0 and settled(steps, rising, tol=0.02)
    late = [0.1] * 20 + [0.4, 0.7, 0.9, 0.97]  # the task learnt in the last quarter
    assert change_over_last(steps, late) == pytest.approx(0.87) and not settled(steps, late, tol=0.02)
    noisy = [0.5] * 17 + [0.509, 0.491, 0.5, 0.505, 0.495, 0.5, 0.509]  # within ±0.01 of 0.5
    assert change_over_last(steps, noisy) == pytest.approx(0.018) and settled(steps, noisy, tol=0.02)
    assert not settled(steps, noisy, tol=0.01)


def test_too_coarse_or_broken_curves_never_settle():
    assert math.isnan(change_over_last([100, 1000], [0.5, 0.5]))  # one point in the last quarter
    assert not settled([100, 1000], [0.5, 0.5], tol=1.0)
    assert not settled([800, 900, 1000], [0.5, math.nan, 0.5], tol=1.0)
    with pytest.raises(ValueError, match="ascend"):
        change_over_last([2, 1], [0, 0])
    with pytest.raises(ValueError, match="as many"):
        change_over_last([1, 2], [0])


def test_budgets_double_until_settled_or_the_ceiling():
    assert next_budget(6000, False, 24000) == 12000
    assert next_budget(12000, False, 24000) == 24000
    assert next_budget(24000, False, 24000) is None  # the ceiling: read as not settled
    assert next_budget(6000, True, 24000) is None
