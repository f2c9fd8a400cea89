"""The memory measurements: the MQAR generator (deterministic, keys then queries, loss only at the
queried positions), recall learnt by a small attention model, and the position and reset curves."""
import math

import pandas as pd
import pytest
import torch

from fractus.experiments import memory as M
from fractus.baseline import Transformer, TransformerConfig
from fractus.model import FractusConfig, FractusCTE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mqar_is_deterministic_and_scores_only_the_queries():
    x, y = M.mqar(50, 40, 6, 64, seed=3)
    x2, y2 = M.mqar(50, 40, 6, 64, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, M.mqar(50, 40, 6, 64, seed=4)[0])
    for xs, ys in zip(x, y):
        keys, values = xs[0:12:2], xs[1:12:2]
        assert len(set(keys.tolist())) == 6 and (keys >= 1).all() and (keys < 32).all() and (values >= 32).all()
        scored = (ys != -100).nonzero().flatten()
        assert len(scored) == 6 and (scored >= 12).all()  # each key queried once, after the pairs
        for t in scored:  # the query is the key, the target its value
            i = keys.tolist().index(int(xs[t]))
            assert ys[t] == values[i]
        rest = torch.ones(40, dtype=torch.bool)
        rest[:12] = False
        rest[scored] = False
        assert (xs[rest] == 0).all()  # filler elsewhere
    with pytest.raises(ValueError, match="do not fit"):
        M.mqar(1, 10, 4, 64, seed=0)


def test_a_small_attention_model_learns_two_pair_recall():
    run = M.train_recall(M.RecallModel("t", kind="transformer"), 3e-3, 0, d_model=32, steps=600, batch=64, vocab=32,
                         n_test=500, mix=((12, 2),), tests=((12, 2), (16, 2)), curve_points=12, n_probe=100)
    rows, curve = run.rows, run.curve
    assert [(r["seq_len"], r["pairs"], r["trained_on"]) for r in rows] == [(12, 2, True), (16, 2, False)]
    assert rows[0]["params"] < 30_000 and rows[0]["accuracy"] > 0.9, rows
    # the learning curve: 12 held-out points, rising from chance to the learnt task, still rising over
    # the last quarter (steps 450–600) by more than the rule allows: not settled at this budget
    assert [c["step"] for c in curve] == list(range(50, 601, 50)) and all(c["model"] == "t" for c in curve)
    assert curve[0]["probe_accuracy"] < 0.5 < 0.9 < curve[-1]["probe_accuracy"], curve
    tail = [c["probe_accuracy"] for c in curve[8:]]
    assert rows[0]["probe_change"] == max(tail) - min(tail) > 0.02 and not rows[0]["settled"]


def test_the_transformers_short_convolution_is_causal():
    torch.manual_seed(0)
    tf = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=2, context=20, short_conv=4))
    x = torch.randint(0, 50, (2, 20))
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 50
    a, b = tf(x)[0], tf(y)[0]
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6) and not torch.allclose(a[:, 12], b[:, 12])
    with pytest.raises(ValueError, match="short_conv"):
        TransformerConfig(short_conv=1)


def test_chance_is_the_floor_before_training():
    model = M.RecallModel("default").build(32, 1, 64, 24)
    assert M.recall_accuracy(model, 24, 4, 64, 200) < 0.2  # 32 values: chance 1/32


def test_position_and_reset_curves():
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (2001,)).numpy()
    cte = FractusCTE(FractusConfig.preset("tiny", vocab_size=50))
    short = M.window_losses(cte, tokens, 25, batch=7)  # 80 windows, read cold, in batches
    assert short.shape == (80, 25) and torch.allclose(short, M.token_losses(cte, tokens, 80, 25, carried=False))
    long = M.token_losses(cte, tokens, 4, 25)  # 4 streams of 500, the state carried
    rows = M.ce_by_position(cte, tokens, 4, 25, window=25, buckets=(0, 16, 64, 256))
    assert [(r["bucket_lo"], r["bucket_hi"], r["tokens"]) for r in rows] == [
        (0, 16, 80 * 16), (16, 64, 80 * 9 + 4 * 39), (64, 256, 4 * 192), (256, 500, 4 * 244)]
    assert abs(rows[1]["ce"] - float(torch.cat([short[:, 16:].flatten(), long[:, 25:64].flatten()]).mean())) < 1e-5
    assert abs(rows[3]["ce"] - float(long[:, 256:].mean())) < 1e-5
    resets = M.ce_with_resets(cte, tokens, 4, 25, resets=(25, 100, 1000))
    assert [r["reset"] for r in resets] == [None, 25, 100]  # 1000 > a stream's 500 tokens
    assert abs(resets[0]["ce"] - float(long.mean())) < 1e-6
    tf = Transformer(TransformerConfig(vocab_size=50, d_model=32, head_dim=16, n_layers=1, context=25))
    rows = M.ce_by_position(tf, tokens, 4, 25, window=25, buckets=(0, 16, 64))
    assert [(r["bucket_lo"], r["bucket_hi"]) for r in rows] == [(0, 16), (16, 25)]  # within its context


def test_the_recall_grid_trains_until_settled_and_keeps_finished_runs(tmp_path):
    csv, log = tmp_path / "recall_cpu.csv", []
    kw = dict(d_model=32, steps=4, vocab=32, batch=8, n_test=50, mix=((12, 2), (16, 3)), tests=((16, 3), (24, 4)),
              curve_points=4, n_probe=20)
    jobs = [("transformer", 3e-3, 0), ("default", 3e-3, 0)]
    rows = M.run_recall(jobs, csv, workers=1, log=log.append, max_steps=8, runs=tmp_path / "runs", **kw)
    assert not list((tmp_path / "runs").glob("*.pt"))  # each finished run's resume point removed
    assert rows["git_sha"].notna().all() and set(rows["model"]) == {"default", "transformer"}
    assert rows["device"].str.endswith("(1 threads)").all()  # the worker's threads, not this process's
    assert list(rows["trained_on"][:2]) == [True, False]  # a row per test setting, in the mix or not
    budgets = M.recall_budgets(csv)  # a run that had not settled at 4 steps trained again at 8, then stopped
    for b in budgets.values():
        assert set(b) in ({4}, {4, 8}) and (b[4] or set(b) == {4, 8}), budgets
    curves = pd.read_csv(tmp_path / "recall_curves_cpu.csv")
    assert len(curves) == sum(len(b) for b in budgets.values()) * 4  # 4 points a run
    read = M.settled_reading(rows)
    assert len(read) == 4 and all(read.groupby("model")["steps"].nunique() == 1)
    again = M.run_recall(jobs, csv, workers=1, log=log.append, max_steps=8, **kw)
    assert len(again) == len(rows) and log[-1] == f"2 of 2 recall runs kept from {csv}"
    assert M.pending_budget({4: False, 8: False}, 4, 16) == 16 and M.pending_budget({4: True}, 4, 16) is None


def test_a_stopped_recall_run_continues_exactly_from_its_resume_point(tmp_path, monkeypatch):
    kw = dict(d_model=32, steps=12, vocab=32, batch=8, n_test=50, mix=((12, 2), (16, 3)), tests=((16, 3), (24, 4)),
              curve_points=4, n_probe=20)
    model, resume = M.RECALL_BY_NAME["default"], tmp_path / "run.pt"
    whole = M.train_recall(model, 3e-3, 0, **kw)
    scored, calls = M.recall_accuracy, []

    def stopped_at_the_third_point(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return scored(*args, **kwargs)

    monkeypatch.setattr(M, "recall_accuracy", stopped_at_the_third_point)
    with pytest.raises(KeyboardInterrupt):
        M.train_recall(model, 3e-3, 0, resume=resume, **kw)
    assert torch.load(resume, weights_only=True)["step"] == 6  # the points at steps 3 and 6 were saved
    monkeypatch.setattr(M, "recall_accuracy", scored)
    resumed = M.train_recall(model, 3e-3, 0, resume=resume, **kw)
    assert not resume.exists()  # removed once the run is scored
    drop = lambda rows: [{k: v for k, v in r.items() if k != "train_s"} for r in rows]
    assert drop(resumed.rows) == drop(whole.rows) and resumed.curve == whole.curve
    M.train_recall(model, 3e-3, 0, resume=resume, **{**kw, "steps": 8})  # removed again when it ends
    torch.save({"setting": "another run"}, resume)
    with pytest.raises(ValueError, match="another recall run"):
        M.train_recall(model, 3e-3, 0, resume=resume, **kw)
    assert M.resume_path(tmp_path, "default + delta rule", 1e-2, 0, {"d_model": 64, "vocab": 512, "steps": 6000}) \
        == tmp_path / "default_delta_rule-lr0.01-seed0-d64-v512-6000.pt"


def test_the_rate_sweep_stops_once_its_best_is_bracketed():
    assert M.next_rate({}) == 1e-2 and M.next_rate({1e-2: 0.5}) == 3e-2
    assert M.next_rate({1e-2: 0.5, 3e-2: 0.6}) == 1e-1  # the best's untried neighbour
    assert M.next_rate({1e-2: 0.5, 3e-2: 0.6, 1e-1: 0.4}) is None  # bracketed by two worse rates
    assert M.next_rate({1e-2: 0.6, 3e-2: 0.5}) == 3e-3
    assert M.next_rate({1e-2: 0.6, 3e-2: 0.5, 3e-3: 0.55}) is None
    assert M.next_rate({3e-3: 0.7, 1e-2: 0.6, 3e-2: 0.5}) == 1e-3
    assert M.next_rate({1e-3: 0.8, 3e-3: 0.7, 1e-2: 0.6, 3e-2: 0.5}) is None  # the grid's end
    assert M.next_rate({1e-2: 0.5, 3e-2: 0.5, 3e-3: 0.4}) is None  # a tie goes to the lower rate
    assert M.next_rate({1e-2: 0.5, 3e-2: 0.6, 5e-2: 0.9, 1e-1: 0.4}) is None  # off the grid: not read


def test_the_rate_sweep_goes_down_from_a_rate_the_model_did_not_learn_at():
    stuck = {1e-2: False}
    assert M.next_rate({1e-2: 0.07}, learnt=stuck) == 3e-3  # 3e-2, a start rate above it, not tried
    assert M.next_rate({1e-2: 0.07, 3e-3: 0.5}, learnt=stuck) == 1e-3
    assert M.next_rate({1e-2: 0.07, 3e-3: 0.5, 1e-3: 0.4}, learnt=stuck) is None  # bracketed
    # a run that did not learn ranks below every run that did, whatever its score
    assert M.next_rate({1e-2: 0.3, 3e-2: 0.2}, learnt={1e-2: False, 3e-2: True}) == 1e-1
    assert M.next_rate({1e-2: 0.3, 3e-2: 0.2, 1e-1: 0.1}, learnt={1e-2: False, 3e-2: True}) is None


def test_a_run_left_chance_when_it_beats_twice_the_in_context_guess_on_what_it_trained_on():
    def run(lr, trained, other):
        return [dict(model="m", lr=lr, seed=0, d_model=64, vocab=512, steps=6000, seq_len=256, pairs=16,
                     trained_on=True, accuracy=trained),
                dict(model="m", lr=lr, seed=0, d_model=64, vocab=512, steps=6000, seq_len=1024, pairs=128,
                     trained_on=False, accuracy=other)]
    rows = pd.DataFrame(run(1e-2, 0.07, 0.0) + run(3e-3, 2 / 16, 0.0) + run(1e-3, 0.124, 0.9))
    assert M.left_chance(rows).to_dict() == {1e-3: False, 3e-3: True, 1e-2: False}  # untrained settings not read
    assert M.swept_rate(rows) == 3e-3  # the only run that learnt, not the highest score
    # no setting trained on: every setting read, and none left chance on all of them: the best score
    assert M.swept_rate(rows.assign(trained_on=False)) == 1e-3


def test_the_recall_grid_sweeps_then_seeds_then_widens(tmp_path):
    csv, log = tmp_path / "recall_cpu.csv", []
    kw = dict(d_model=32, steps=4, max_steps=8, vocab=32, batch=8, n_test=20, mix=((12, 2), (16, 3)),
              tests=((16, 3), (24, 4)), curve_points=2, n_probe=10, workers=1, log=log.append)
    models = ("default", "transformer + short conv")  # a model that borrows a rate: the test below
    best = M.recall_grid(csv, models, seeds=(0, 1), wide=64, rates=(3e-3, 1e-2), start=(3e-3,), **kw)
    rows = M.read_recall(csv)
    for m in ("default", "transformer + short conv"):  # both rates tried on seed 0, the best is the higher score
        swept = rows[(rows.model == m) & (rows.seed == 0) & (rows.d_model == 32)]
        assert set(swept["lr"]) == {3e-3, 1e-2} and best[m] == M.swept_rate(swept[swept.steps == 4], (3e-3, 1e-2))
        assert set(swept[swept.lr != best[m]]["steps"]) == {4}  # the sweep compares rates at the first budget
    for m in models:
        at = rows[(rows.model == m) & (rows.lr == best[m]) & (rows.d_model == 32)]
        assert sorted(at["seed"].unique()) == [0, 1]
    wide = M.settled_reading(rows[rows.d_model == 64])  # each run at its last budget
    assert set(wide["model"]) == {"default", "transformer + short conv"} and len(wide) == 2 * 2 * 2
    assert M.recall_grid(csv, models, seeds=(0, 1), wide=64, rates=(3e-3, 1e-2), start=(3e-3,), **kw) == best
    assert len(M.read_recall(csv)) == len(rows)  # every run kept: nothing trained again


def test_a_model_at_chance_at_the_defaults_rate_gets_a_rate_of_its_own(monkeypatch):
    """A model not swept borrows the default's rate if its seed-0 run leaves chance there; one that
    does not has its rate swept from the default's (here: down to where it learns)."""
    learns = {"default": {1e-2, 3e-2}, "default − window": {3e-3}, "original": {1e-2}}
    table = []

    def fake_run(jobs, csv, **kw):
        for m, lr, seed in jobs:
            if not any((r["model"], r["lr"], r["seed"]) == (m, lr, seed) for r in table):
                score = 0.9 - abs(math.log10(lr) + 2) / 10 if lr in learns[m] else 0.06
                table.append(dict(model=m, lr=lr, seed=seed, d_model=64, vocab=M.VOCAB, steps=M.STEPS, seq_len=256,
                                  pairs=16, trained_on=True, accuracy=score))
    monkeypatch.setattr(M, "run_recall", fake_run)
    monkeypatch.setattr(M, "read_recall", lambda csv: pd.DataFrame(table, columns=[
        "model", "lr", "seed", "d_model", "vocab", "steps", "seq_len", "pairs", "trained_on", "accuracy"]))
    best = M.recall_grid("recall.csv", tuple(learns), seeds=(0,), wide=None, swept=("default",))
    assert best == {"default": 1e-2, "default − window": 3e-3, "original": 1e-2}
    tried = pd.DataFrame(table).groupby("model")["lr"].apply(set)
    assert tried["original"] == {1e-2}  # left chance at the default's rate: kept it
    assert tried["default − window"] == {1e-2, 3e-3, 1e-3}  # bracketed below the rate it did not learn at


def test_the_recall_grid_trains_the_seeds_until_they_settle_by_default(monkeypatch):
    """Without ``max_steps`` the grid's runs from each seed may double their budget up to
    MAX_STEPS (the sweep keeps its first budget); a ``max_steps`` given is kept."""
    calls = []
    monkeypatch.setattr(M, "sweep", lambda models, csv, rates, start, **kw: calls.append(("sweep", kw)) or
                        dict.fromkeys(models, 1e-2))
    monkeypatch.setattr(M, "run_recall", lambda jobs, csv, **kw: calls.append(("seeds", kw)))
    M.recall_grid("recall.csv", ("default",), seeds=(0,), wide=None, workers=1)
    assert [c[0] for c in calls] == ["sweep", "seeds"] and calls[1][1]["max_steps"] == M.MAX_STEPS
    calls.clear()
    M.recall_grid("recall.csv", ("default",), seeds=(0,), wide=None, max_steps=M.STEPS)
    assert calls[1][1]["max_steps"] == M.STEPS  # as given


def test_the_recall_cli_refuses_bad_input(capsys):
    for argv in (["recall", "--models", "nope"], ["recall", "--lrs", "-1"], ["recall", "--steps", "0"], []):
        with pytest.raises(SystemExit) as e:
            M.main(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("recall_model", M.RECALL_MODELS, ids=lambda m: m.name)
def test_every_recall_model_is_what_its_name_says(recall_model):
    """Each model of the grid builds at a small width with its changes applied and reads a batch."""
    model = recall_model.build(32, 1, 64, 24)
    changes = dict(recall_model.changes)
    if recall_model.kind == "transformer":
        assert isinstance(model, Transformer) and model.cfg.short_conv == changes.get("short_conv", 0)
    else:
        base = FractusConfig.preset(recall_model.preset, vocab_size=64)
        assert all(getattr(model.cfg, k) == v for k, v in changes.items())
        assert all(getattr(model.cfg, k) == getattr(base, k) for k in ("decay_gate", "short_conv", "attn_norm",
                   "attn_window", "n_levels", "router", "attn_update") if k not in changes)
    x, _ = M.mqar(2, 24, 4, 64, seed=0)
    assert model(x)[0].shape == (2, 24, 64)


def test_a_lead_counts_only_beyond_the_spread_over_seeds():
    def rows(model, accs):  # one setting's accuracy per seed, and a second setting at 0.5 for every seed
        return [{"model": model, "seq_len": 256, "pairs": p, "seed": s, "accuracy": a}
                for s, acc in enumerate(accs) for p, a in ((32, acc), (64, 0.5))]
    r = pd.DataFrame(rows("delta", [0.97, 0.70, 0.90]) + rows("default", [0.92, 0.95, 0.93]) + rows("other", [0.5]))
    t = M.lead(r, "delta", "default")
    at = t.loc[(256, 32)]
    assert at["lead"] == pytest.approx((0.97 + 0.70 + 0.90 - 0.92 - 0.95 - 0.93) / 3)  # behind on the mean
    assert at["spread"] == pytest.approx(0.27) and not at["beyond"] and at["seeds"] == 3
    assert t.loc[(256, 64), "lead"] == 0 and not t.loc[(256, 64), "beyond"]
    r2 = pd.DataFrame(rows("delta", [0.97, 0.96, 0.98]) + rows("default", [0.92, 0.91, 0.93]))
    assert M.lead(r2, "delta", "default").loc[(256, 32), "beyond"]  # 0.05 ahead, spreads 0.02
    assert bool(M.lead(r2, "default", "delta").loc[(256, 32), "beyond"])  # behind by as much: beyond too
    one = r2[r2.seed == 0]
    assert one.pipe(M.lead, "delta", "default").loc[(256, 32), "seeds"] == 1
    assert not M.lead(one, "delta", "default")["beyond"].any()  # one seed: no spread to judge by
    with pytest.raises(ValueError, match="no rows of 'nope'"):
        M.lead(r, "nope", "default")
