"""The comparison runner: its phases' jobs, the choice of each model's rate, and a run that keeps
what is already measured and resumes what was stopped."""
import pandas as pd
import pytest

from fractus.experiments import compare as C
from fractus.experiments.architecture import STEP_TOKENS, Variant
from util import make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(spec):
    """CSV rows from (model, lr, seed, val_ce) at 3 M tokens, each model's own reading."""
    return pd.DataFrame([{"model": m, "lr": lr, "seed": s, "tokens": C.trained_tokens(C.DEMO_TOKENS),
                          "eval": C.headline_reading(m), "val_ce": ce, "val_bpb": ce / 2, "tok_s": 1000.0, "phase": "sweep"}
                         for m, lr, s, ce in spec])


def test_sweep_then_seeds_and_budget_at_each_model_s_best_rate():
    sweep = C.phase_jobs("sweep", None)
    assert sorted(sweep) == sorted((m, lr, 0, C.DEMO_TOKENS) for m in C.MODELS for lr in C.LRS[m])
    assert [j[:2] for j in sweep[:4]] == [("transformer", 1.5e-3), ("original", 1.5e-3), ("default", 3e-3),
                                          ("default", 6e-3)]  # middles first
    lever = C.phase_jobs("sweep", None, models=("default − decay gate",))
    assert [j[1] for j in lever] == [1.5e-3, 7.5e-4, 3e-3, 3.75e-4, 6e-3]  # RATES, from the middle out
    r = rows([("default", 1.5e-3, 0, 4.4), ("default", 3e-3, 0, 4.3), ("transformer", 1.5e-3, 0, 4.2),
              ("transformer", 3e-3, 0, 4.5), ("original", 3e-3, 0, 5.0)])
    r = pd.concat([r, r.assign(eval="chunks", val_ce=1.0)[r["model"] == "transformer"]])  # not its headline
    assert C.best_lr(r, "default") == 3e-3 and C.best_lr(r, "transformer") == 1.5e-3
    seeds = C.phase_jobs("seeds", r)
    assert ("default", 3e-3, 2, C.DEMO_TOKENS) in seeds and len(seeds) == 3 * len(C.SEEDS)
    assert C.phase_jobs("budget", r) == [(m, lr, 0, C.BUDGET_TOKENS) for m, lr in
                                         (("default", 3e-3), ("transformer", 1.5e-3), ("original", 3e-3))]
    assert C.phase_jobs("variants", r, lr=2e-3) == [(m, 2e-3, 0, C.DEMO_TOKENS) for m in C.VARIANTS]
    assert {j[1] for j in C.phase_jobs("variants", r)} == {3e-3}  # the default's best
    one = next(iter(C.VARIANTS))  # --models names the variants to train, and only those
    assert C.phase_jobs("variants", r, models=[one], lr=2e-3) == [(one, 2e-3, 0, C.DEMO_TOKENS)]
    with pytest.raises(ValueError, match="variants trains variants"):
        C.phase_jobs("variants", r, models=["default"])
    t = C.summary(r)
    assert t.loc["default", "ce_vs_transformer"] == pytest.approx(0.1)
    # a second rate run from as many seeds as the sweep's best, and better on them, is the tuned one
    more = pd.concat([r, rows([("default", 3e-3, s, 4.35) for s in (1, 2)] + [("default", 1.5e-3, s, 4.3) for s in (1, 2)])])
    assert C.best_lr(more[more["seed"] == 0], "default") == 3e-3
    assert C.tuned_lr(more, "default") == 1.5e-3 and C.tuned_lr(more, "transformer") == 1.5e-3
    assert C.summary(more).loc["default", "lr"] == 1.5e-3
    assert C.phase_jobs("budget", more)[0] == ("default", 1.5e-3, 0, C.BUDGET_TOKENS)
    with pytest.raises(ValueError, match="no original runs"):
        C.best_lr(r[r["model"] != "original"], "original")


def test_run_appends_each_reading_keeps_finished_runs_and_resumes_stopped_ones(tmp_path):
    data = make_corpus(tmp_path)
    models = {"default": Variant("default", "recipe", preset="tiny", chunk_len=16, batch_size=2),
              "transformer": Variant("transformer", "baseline", model="transformer", preset="tiny", chunk_len=16,
                                     batch_size=2)}
    csv, runs, tokens = tmp_path / "compare.csv", tmp_path / "runs", 3 * STEP_TOKENS
    jobs = [("default", 1e-3, 0, tokens), ("transformer", 1e-3, 0, tokens)]
    # a stopped run: its directory holds a checkpoint at step 1 of 3
    from fractus.training.command import train
    stopped = C.run_dir(runs, "transformer", 1e-3, 0, tokens)
    train(models["transformer"].argv(data, stopped, tokens, 0, 1) + ["--lr", "0.001", "--stop-after", "1"])
    log = []
    out = C.run(jobs, data, csv, runs, "sweep", workers=1, log=log.append, models=models)
    assert sorted(zip(out["model"], out["eval"])) == [("default", "carried"), ("transformer", "chunks"),
                                                      ("transformer", "sliding")]
    assert (out["tokens"] == tokens).all() and (out["params"] > 0).all() and out["git_sha"].notna().all()
    fresh = tmp_path / "fresh"
    train(models["transformer"].argv(data, fresh, tokens, 0, 1) + ["--lr", "0.001"])
    from fractus.training.runs import read_metrics
    assert read_metrics(stopped / "metrics.csv")[-1]["val_ce"] == read_metrics(fresh / "metrics.csv")[-1]["val_ce"]
    again = C.run(jobs, data, csv, runs, "sweep", workers=1, log=log.append, models=models)
    assert len(again) == 3 and log[-1] == f"2 of 2 runs kept from {csv}"


def test_timing_takes_turns(tmp_path):
    data = make_corpus(tmp_path)
    models = {"default": Variant("default", "recipe", preset="tiny", chunk_len=16, batch_size=2),
              "transformer": Variant("transformer", "baseline", model="transformer", preset="tiny", chunk_len=16,
                                     batch_size=2)}
    t = C.timing(["default", "transformer"], data, steps=7, rounds=2, threads=1, models=models, log=lambda s: None)
    assert list(zip(t["round"], t["model"])) == [(0, "default"), (0, "transformer"), (1, "default"),
                                                 (1, "transformer")]
    assert (t["tok_s"] > 0).all()


def test_a_variant_s_warm_up_is_the_trainer_s_unless_it_names_its_steps():
    assert "--warmup" not in C.MODELS["transformer"].argv("d", "o", C.DEMO_TOKENS, 0, 1)  # the trainer's 5 %
    argv = C.VARIANTS["transformer, warm-up 50"].argv("d", "o", C.DEMO_TOKENS, 0, 1)
    assert argv[argv.index("--warmup") + 1] == "50"
