"""The growth measurement: both paths as curves of CE against cumulative FLOPs, kept rows not
trained again, and the saving read off the curves."""
import math

import pandas as pd
import pytest

from fractus.experiments import growth as G
from util import make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")
READING = ["--batch-size", "2", "--chunk-len", "16", "--accum", "1"]


def test_reach_interpolates_and_saving_reads_the_curves():
    c = pd.DataFrame({"flops": [1.0, 2.0, 4.0], "val_ce": [5.0, 4.0, 3.0]})
    assert G.reach(c, 3.5) == pytest.approx(3.0) and G.reach(c, 6.0) == 1.0 and math.isnan(G.reach(c, 2.0))
    row = dict(lr=1e-3, val_bpb=0.0, stage=0, preset="p")
    rows = pd.DataFrame(
        [{"path": "scratch", "schedule": "s", "seed": 0, "flops": f, "val_ce": ce, "wall_s": f, **row}
         for f, ce in ((2.0, 4.5), (4.0, 4.0))]
        + [{"path": "grown", "schedule": "g", "seed": 0, "flops": f, "val_ce": ce, "wall_s": 2 * f, **row}
           for f, ce in ((1.0, 4.6), (2.0, 4.2), (3.0, 3.8))])
    s = G.saving(rows, grown="g", scratch="s").iloc[0]
    assert s["scratch_ce"] == 4.0 and s["grown_ce"] == 3.8
    assert s["grown_flops_to_reach"] == pytest.approx(2.5) and s["flops_ratio"] == pytest.approx(2.5 / 4)
    assert s["wall_ratio"] == pytest.approx(5.0 / 4)


def test_both_paths_train_once_and_give_curves(tmp_path):
    data = make_corpus(tmp_path)
    csv, runs = tmp_path / "growth.csv", tmp_path / "runs"
    jobs = [("grown", "tiny:128,tiny:192", 1e-3, 0), ("scratch", "tiny:256", 1e-3, 0)]
    rows = G.run(jobs, data, csv, runs, eval_every=2, threads=1, log=lambda *_: None, reading=READING)
    assert set(G.COLUMNS) <= set(rows.columns) and rows["val_ce"].notna().all()
    grown = rows[rows["path"] == "grown"]
    assert list(grown["stage"].unique()) == [0, 1] and grown["flops"].is_monotonic_increasing
    assert grown["tokens"].max() == 320 and rows[rows["path"] == "scratch"]["tokens"].max() == 256
    assert grown["wall_s"].is_monotonic_increasing and (rows["wall_s"] > 0).all()
    again = G.run(jobs, data, csv, runs, eval_every=2, threads=1, log=lambda *_: None, reading=READING)
    assert len(again) == len(rows)  # kept, not trained again
    assert len(G.saving(rows, *(j[1] for j in jobs))) == 1
