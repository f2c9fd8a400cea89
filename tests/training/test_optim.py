"""The learning-rate curves (:func:`fractus.training.optim.lr_lambda`): the cosine of a single run,
warmup-stable-decay, and a schedule's stages reading one curve."""
import math

import pytest

from fractus.training.optim import lr_lambda


def test_cosine_is_the_warm_up_then_half_a_cosine_to_the_floor():
    f = lr_lambda(5, 105, 0.1)
    assert [f(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert f(5) == 1.0 and f(55) == pytest.approx(0.55) and f(105) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert f(30) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 25 / 100)))


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction():
    f = lr_lambda(5, 105, 0.1, "wsd", 0.2)  # decay over the last 20 of the 100 steps after the warm-up
    assert [f(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(f(s) == 1.0 for s in range(5, 86))
    assert f(95) == pytest.approx(1 - 0.9 * 10 / 20) and f(105) == pytest.approx(0.1) and f(200) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="shape 'linear'"):
        lr_lambda(5, 105, 0.1, "linear")


@pytest.mark.parametrize("shape", ["cosine", "wsd"])
def test_stages_on_one_curve_read_it_where_they_stand(shape):
    """A schedule of 40 + 60 steps on one curve: the first stage is the whole curve's first 40 steps;
    the second, after its own warm-up of 10, the curve from step 40 on."""
    whole = lr_lambda(4, 100, 0.1, shape)
    first = lr_lambda(4, 40, 0.1, shape, offset=0, span=100, decay_start=4)
    second = lr_lambda(10, 60, 0.1, shape, offset=40, span=100, decay_start=4)
    assert [first(s) for s in range(40)] == [whole(s) for s in range(40)]
    assert [second(s) for s in range(10, 60)] == [whole(s) for s in range(50, 100)]
    assert [second(s) for s in range(10)] == pytest.approx([(s + 1) / 10 * whole(40 + s) for s in range(10)])
