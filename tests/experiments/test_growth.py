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
        [{"config": "s", "path": "scratch", "seed": 0, "flops": f, "val_ce": ce, "wall_s": f, **row}
         for f, ce in ((2.0, 4.5), (4.0, 4.0))]
        + [{"config": "g", "path": "grown", "seed": 0, "flops": f, "val_ce": ce, "wall_s": 2 * f, **row}
           for f, ce in ((1.0, 4.6), (2.0, 4.2), (3.0, 3.8))]
        + [{"config": "h", "path": "grown", "seed": 0, "flops": f, "val_ce": ce, "wall_s": f, **row}
           for f, ce in ((1.0, 4.6), (3.0, 4.1))])
    s = G.saving(rows, grown="g", scratch="s").iloc[0]
    assert s["scratch_ce"] == 4.0 and s["grown_ce"] == 3.8
    assert s["grown_flops_to_reach"] == pytest.approx(2.5) and s["flops_ratio"] == pytest.approx(2.5 / 4)
    assert s["wall_ratio"] == pytest.approx(5.0 / 4)
    assert not s["scratch_settled"]  # one point in its last quarter: too coarse to say it settled
    flat = pd.concat([rows, pd.DataFrame([{"config": "s", "path": "scratch", "seed": 0, "flops": 3.5, "val_ce": 4.01,
                                           "wall_s": 3.5, **row}])])
    assert G.saving(flat, grown="g", scratch="s").iloc[0]["scratch_settled"]  # 4.01 → 4.0: within 0.02
    falling = flat.assign(val_ce=flat["val_ce"].where(flat["flops"] != 3.5, 4.05))
    assert not G.saving(falling, grown="g", scratch="s").iloc[0]["scratch_settled"]
    ranked = G.ranking(rows, scratch="s")  # g reaches the scratch CE, h never does: g first
    assert list(ranked["config"]) == ["g", "h"] and math.isnan(ranked["flops_ratio"].iloc[1])
    assert not ranked["scratch_settled"].any()


def test_both_paths_train_once_and_give_curves(tmp_path):
    data = make_corpus(tmp_path)
    csv, runs = tmp_path / "growth.csv", tmp_path / "runs"
    jobs = [G.Job("g", "grown", "tiny:128,tiny:192", 1e-3, 0), G.Job("s", "scratch", "tiny:256", 1e-3, 0)]
    rows = G.run(jobs, data, csv, runs, eval_every=2, threads=1, log=lambda *_: None, reading=READING)
    assert set(G.COLUMNS) <= set(rows.columns) and rows["val_ce"].notna().all()
    grown = rows[rows["path"] == "grown"]
    assert list(grown["stage"].unique()) == [0, 1] and grown["flops"].is_monotonic_increasing
    assert grown["tokens"].max() == 320 and rows[rows["path"] == "scratch"]["tokens"].max() == 256
    assert grown["wall_s"].is_monotonic_increasing and (rows["wall_s"] > 0).all()
    again = G.run(jobs, data, csv, runs, eval_every=2, threads=1, log=lambda *_: None, reading=READING)
    assert len(again) == len(rows)  # kept, not trained again
    assert len(G.saving(rows, "g", "s")) == 1
    # a job whose first stage is g's (same stage, seed, rate, flags) starts from g's trained one;
    # one on a single rate curve across its stages trains its own
    twin = G.Job("g, warm-up 3", "grown", "tiny:128,tiny:192:warmup=3", 1e-3, 0)
    apart = G.Job("g, one curve", "grown", "tiny:128,tiny:192", 1e-3, 0, ("--stage-lr", "continue"))
    rows = G.run([twin, apart], data, csv, runs, eval_every=2, threads=1, log=lambda *_: None, reading=READING)
    first = {c: rows[(rows["config"] == c) & (rows["stage"] == 0)]["val_ce"].tolist() for c in ("g", twin.config, apart.config)}
    assert first[twin.config] == first["g"] and first[apart.config] != first["g"]
    stage0 = [(G.run_dir(runs, j) / "0-tiny" / "metrics.csv").read_text() for j in (jobs[0], twin)]
    assert stage0[0] == stage0[1]  # the same record: copied, not trained again (times differ run to run)
    assert rows[rows["config"] == twin.config]["val_ce"].iloc[-1] != rows[rows["config"] == "g"]["val_ce"].iloc[-1]


def test_jump_validates_the_grown_model_from_its_first_step(tmp_path):
    """The grown model before any update has the small model's CE (the same logits); after each
    step of the list, the CE of the stage run that far — the same as one run straight to it."""
    data = make_corpus(tmp_path)
    csv, runs = tmp_path / "jump.csv", tmp_path / "runs"
    settings = {"a": (1.0, 2, "interleave"), "b": (0.5, 2, "stack")}
    rows = G.jump(data, csv, runs, 1e-3, settings=settings, steps=(1, 3), eval_every=2, threads=1,
                  log=lambda *_: None, reading=READING, small="128", target="0.256K", presets=("tiny", "tiny"))
    assert set(G.JUMP_COLUMNS) <= set(rows.columns) and len(rows) == 6
    small = pd.read_csv(G.run_dir(runs, G.Job("tiny alone", "grown", f"tiny:128:lr={G.SMALL_LR:g}", 1e-3, 0))
                        / "metrics.csv")["val_ce"].dropna().iloc[-1]
    a = rows[rows["config"] == "a"].set_index("step")["val_ce"]
    assert a[0] == pytest.approx(small, rel=1e-5) and a[1] != a[0] and list(a.index) == [0, 1, 3]
    assert rows[rows["config"] == "b"]["lr"].iloc[0] == 5e-4
    from fractus.training.command import train  # step 3 of "a", trained in one go
    ckpt = next(runs.glob("grown-tiny_alone*")) / "0-tiny" / "ckpt.pt"
    out = tmp_path / "straight"
    train(["--grow-from", str(ckpt), "--preset", "tiny", "--tokens", "256", "--data", str(data), "--out", str(out),
           "--lr", "0.001", "--warmup", "2", "--seed", "0", "--threads", "1", "--eval-every", "0", "--ckpt-every", "0",
           "--sample-tokens", "0", "--no-progress", "--stop-after", "3", *READING])
    assert G._jump_row("a", 1e-3, 2, "interleave", 0, 3, out / "ckpt.pt", ckpt,
                       ["--preset", "tiny", "--data", str(data), "--out", str(out), *READING])["val_ce"] == a[3]
    again = G.jump(data, csv, runs, 1e-3, settings=settings, steps=(1, 3), eval_every=2, threads=1,
                   log=lambda *_: None, reading=READING, small="128", target="256", presets=("tiny", "tiny"))
    assert len(again) == 6  # kept


def test_the_search_configs_are_the_schedules_they_name():
    lr, small_lr = 3e-3, f"{G.SMALL_LR:g}"
    assert G.search_job("restart", lr, 0).schedule == f"palier0:3M:lr={small_lr},palier1:4M"
    assert G.search_job("restart 0.5x, warm-up 100", lr, 0).schedule.endswith(",palier1:4M:lr=0.0015:warmup=100")
    wsd = G.search_job("continue wsd", lr, 1)
    assert wsd.flags == ("--stage-lr", "continue", "--lr-shape", "wsd") and wsd.seed == 1 and wsd.path == "grown"
    early = G.search_job("grown at 1M", lr, 0, best="restart 0.5x")
    assert early.config == "restart 0.5x, grown at 1M"
    assert early.schedule == f"palier0:1M:lr={small_lr},palier1:4M:lr=0.0015"
    assert G.search_job("stacked", lr, 0, best="restart").schedule.endswith(",palier1:4M:depth=stack")
    tiny = dict(presets=("tiny", "tiny"), small="128", target="192")  # a smaller search: the sizes given
    assert G.search_job("restart 0.25x", lr, 0, **tiny).schedule == f"tiny:128:lr={small_lr},tiny:192:lr=0.00075"
    assert G.search_job("grown at 64", lr, 0, "restart", {"grown at 64": {"small": "64"}}, **tiny).schedule \
        == f"tiny:64:lr={small_lr},tiny:192"
