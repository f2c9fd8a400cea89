"""The optimization table's measurements (:mod:`fractus.experiments.optimizations`): verdicts on the
document's claims, quality effects and costs, the text a short run reads, short runs, and speeds
measured in interleaved rounds."""
import math

import pytest
import torch

from fractus.bench.setup import Setup
from fractus.experiments import optimizations as O
from fractus.model import FractusCTE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_optimization_verdicts():
    assert O.verdict(0.95, 1.37) == "no gain measured (a gain was claimed)"
    assert O.verdict(3.6, 4.0) == O.verdict(4.9, 4.0) == O.AS_CLAIMED
    assert O.verdict(2.0, 4.0) == "smaller than claimed" and O.verdict(6.0, 4.0) == "larger than claimed"


def test_quality_effects():
    assert O.quality_effect([0.03]) == O.LEARNS_LESS and O.quality_effect([-0.03]) == O.LEARNS_MORE
    assert O.quality_effect([0.004]) == O.quality_effect([-0.004]) == O.NO_EFFECT
    assert O.quality_effect([0.01]) == O.quality_effect([-0.01]) == O.SMALL_EFFECT
    assert O.quality_effect([0.02]) == O.quality_effect([-0.02]) == O.quality_effect([0.005]) == O.SMALL_EFFECT
    assert O.quality_effect([0.05, 0.02, 0.03]) == O.LEARNS_LESS  # every seed agrees
    assert O.quality_effect([0.08, -0.01, 0.03]) == O.quality_effect([-0.05, 0.01]) == O.SEED_NOISE
    assert O.quality_effect([0.012, -0.004, 0.001]) == O.NO_EFFECT  # the mean decides first
    for bad in ([float("nan"), 0.1], []):
        with pytest.raises(ValueError, match="no quality cost"):
            O.quality_effect(bad)


def test_quality_cost_pairs_the_seeds():
    run = lambda ce, bpb: {"val_ce": ce, "val_bpb": bpb}  # noqa: E731
    with_opt = [run(5.0, 3.10), run(5.2, 3.20), run(5.1, 3.00)]
    without = [run(4.9, 3.00), run(5.0, 3.15), run(5.0, 2.98)]
    q = O.quality_cost(with_opt, without)
    assert q["quality cost (Δbpb)"] == pytest.approx((0.10 + 0.05 + 0.02) / 3)
    assert q["Δbpb low"] == pytest.approx(0.02) and q["Δbpb high"] == pytest.approx(0.10)
    assert q["val_ce with"] == pytest.approx(5.1) and q["val_bpb without"] == pytest.approx(9.13 / 3)
    assert q["quality effect"] == O.LEARNS_LESS
    with pytest.raises(ValueError, match="3 runs with the optimization against 2 without"):
        O.quality_cost(with_opt, without[:2])


def test_spread_windows():
    import numpy as np
    t = np.arange(1000)
    w = O.spread_windows(t, 80, 8)
    assert len(w) == 81 and w[0] == 0 and w[-1] == 999 - 0 and w[-2] == 998
    pieces = w[:80].reshape(8, 10)
    assert (np.diff(pieces, axis=1) == 1).all() and (np.diff(pieces[:, 0]) > 10).all()  # contiguous, spread out
    assert len(O.spread_windows(t, 2000, 8)) == 1000  # too short: everything


def test_short_train_learns_on_its_slice(tmp_path):
    from fractus.data import prepare
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question.\n" * 400)
    prepare(str(text), tmp_path / "data", 512)
    r = Setup(preset="tiny", vocab_size=512, tie_head=True, sparse_moe=True, fused_ce=True, batch_size=2,
                chunk_len=16, accum=1)
    torch.manual_seed(0)
    model = FractusCTE(r.config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = O.short_train(r, 512, 256, data_dir=tmp_path / "data", train_slice=(0.0, 0.5), model=model)
    assert out["steps"] == 16 and out["tokens"] == 512
    assert math.isfinite(out["val_ce"]) and out["val_ce"] < math.log(512)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_speeds_are_interleaved_and_ratios_taken_round_by_round(monkeypatch):
    a, b, c = Setup(batch_size=1), Setup(batch_size=2), Setup(batch_size=4)
    calls = []

    def fake(setup, **kw):  # the machine halves its speed every round; b is 0.5 × a, c 2 × a
        calls.append(setup.batch_size)
        rnd = (len(calls) - 1) // 3
        return {"tok_s": 100.0 * setup.batch_size / 2 ** rnd * (0.25 if setup.batch_size == 2 else 1)}

    monkeypatch.setattr(O, "measure_speed", fake)
    speeds = O.measure_speeds([a, b, a, c], rounds=4)
    rounds = [calls[i:i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == [1, 2, 4] for r in rounds) and len({tuple(r) for r in rounds}) > 1  # shuffled
    assert speeds[a] == [100.0, 50.0, 25.0, 12.5] and speeds[b] == [50.0, 25.0, 12.5, 6.25]
    assert O.speedup(speeds, b, a) == pytest.approx({"median": 0.5, "low": 0.5, "high": 0.5})
    assert O.speedup(speeds, c, a)["median"] == pytest.approx(4.0)
    rows = O.rounds_rows(speeds, {a: "a", b: "b", c: "c"})
    assert len(rows) == 12 and rows[1] == {"setup": "a", "round": 1, "tok_s": 50.0}
