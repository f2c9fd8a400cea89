"""The Fractus CTE against a tuned Transformer++: learning rates tuned per model, two budgets.

Three models at palier0's width and depth, trained by the trainer itself on the same prepared
tokens at 2,048 tokens a step, evaluated on the same held-out split: the default CTE (8 shuffled
windows of 256 positions, the trainer's default; scored with the state carried through 8
contiguous streams), the original architecture (``original-palier0``, 32 contiguous streams of 64
positions, the state carried) and the Transformer++ (:mod:`fractus.baseline`; 8 shuffled windows
of 256, scored with sliding windows of 256 every 128, and also as the CTE's chunks without
context). Five phases, each over the three models or the ones named (any of :data:`VARIANTS` too):

- ``sweep``: each model at each of its rates (:data:`LRS`, spaced ×2; a variant at :data:`RATES`), one seed;
- ``seeds``: each model at its best rate of the sweep from :data:`SEEDS`;
- ``budget``: each model at its best rate at about 20 tokens per parameter (:data:`BUDGET_TOKENS`);
- ``variants``: each of :data:`VARIANTS` at one rate (``--lr``; the default CTE's best), one seed;
- ``timing``: training tokens/s, the models taking turns in one process (:func:`timing`).

Each run trains in its own directory under ``runs`` and resumes there if it was stopped (one
stopped before its first checkpoint starts again); each finished run adds its rows (one per
evaluation reading: ``eval`` carried, sliding or chunks) to the results CSV whole, with
provenance, and a run whose rows are already there is not trained again (:mod:`.runner`).
Runs go two at a time, one thread each, so that the models' times compare within a run.
``python -m fractus.experiments.compare sweep|seeds|budget|variants|timing --data DIR [--models NAME …]``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from fractus.experiments.architecture import STEP_TOKENS, Variant, trained_tokens
from fractus.experiments import runner
from fractus.training.records import append_csv, write_csv

MODELS = {  # name in the CSV → the model and how it reads the corpus (2,048 tokens a step each)
    "default": Variant("default", "recipe", preset="palier0", chunk_len=256, batch_size=8, sampling="windows"),
    "transformer": Variant("transformer", "baseline", model="transformer", preset="palier0", chunk_len=256,
                           batch_size=8, sampling="windows"),
    "original": Variant("original", "original", preset="original-palier0", chunk_len=64, batch_size=32,
                        sampling="streams", warmup=50),  # the original's setting: 32 streams of 64, 50 warm-up steps
}
# Variants of the three models tried beside them, each named by what it changes: "− decay gate"
# fixes each (level, head)'s decay (FractusConfig.decay_gate off), "− window" turns the softmax
# window level off, "window 128" doubles its width, "+ shared expert 128" adds a dense expert of
# d_ff 128 beside the routed ones (the model stays below the Transformer++'s parameters), "+ delta
# rule" writes the linear levels' state by the gated delta rule (with the RMS read-out it needs), ", one
# level" keeps one linear level instead of two (beside the window level); a
# sampling of the corpus other than the default's 8 shuffled windows of 256 is named, and so is a
# warm-up of 50 optimizer steps instead of the trainer's 5 % of the run's (73 at 3 M tokens).
FIXED = ("decay_gate", False)
VARIANTS = {name: Variant(name, group, model=model, preset=preset, changes=changes, chunk_len=chunk,
                          batch_size=batch, sampling=sampling, warmup=warmup)
            for name, group, model, preset, changes, chunk, batch, sampling, warmup in (
              ("default − decay gate", "lever", "cte", "palier0", (FIXED,), 256, 8, "windows", None),
              ("default + shared expert 128", "lever", "cte", "palier0", (("shared_expert", 128),), 256, 8, "windows",
               None),
              ("default + delta rule", "lever", "cte", "palier0", (("attn_update", "delta"), ("attn_norm", "rms")), 256,
               8, "windows", None),
              ("default, one level", "parts", "cte", "palier0", (("n_levels", 1),), 256, 8, "windows", None),
              ("default − decay gate, warm-up 50", "recipe −", "cte", "palier0", (FIXED,), 256, 8, "windows", 50),
              ("transformer, warm-up 50", "baseline", "transformer", "palier0", (), 256, 8, "windows", 50),
              ("default − decay gate − window, warm-up 50", "lever", "cte", "palier0", (FIXED, ("attn_window", 0)),
               256, 8, "windows", 50),
              ("default − decay gate, window 128, warm-up 50", "lever", "cte", "palier0",
               (FIXED, ("attn_window", 128)), 256, 8, "windows", 50),
              ("default − decay gate, 32 streams of 64, warm-up 50", "sampling", "cte", "palier0", (FIXED,), 64, 32,
               "streams", 50),
              ("default − decay gate − window, 32 streams of 64, warm-up 50", "sampling", "cte", "palier0",
               (FIXED, ("attn_window", 0)), 64, 32, "streams", 50),
              ("default − decay gate − window, 8 streams of 256, warm-up 50", "sampling", "cte", "palier0",
               (FIXED, ("attn_window", 0)), 256, 8, "streams", 50))}


def headline_reading(model: str) -> str:
    """A model's own reading of the held-out split: sliding windows for the transformers (the
    names that start with "transformer"), the state carried through contiguous streams for every CTE."""
    return "sliding" if model.startswith("transformer") else "carried"

RATES = (3.75e-4, 7.5e-4, 1.5e-3, 3e-3, 6e-3)  # AdamW peak rates, ×2 apart
# each model's sweep: RATES, two steps higher for the default CTE (its best on seed 0, 1.2e-2, would
# be the edge of one step higher); the delta rule's: four rates around 6e-3; one level's: 6e-3 and the
# two below
LRS = {m: RATES for m in MODELS} | {"default": (*RATES[1:], 1.2e-2, 2.4e-2),
                                    "default + delta rule": (*RATES[2:], 1.2e-2), "default, one level": RATES[2:]}
DEMO_TOKENS = 3_000_000  # make demo's budget
BUDGET_TOKENS = 27_000_000  # about 20 tokens per parameter at palier0 (1.35–1.44 M parameters)
SEEDS = (0, 1, 2)
COLUMNS = ("model", "preset", "params", "tokens", "lr", "seed", "eval", "val_ce", "val_bpb", "val_ppl", "wall_s",
           "tok_s", "threads", "phase")


def run_dir(runs: Path, model: str, lr: float, seed: int, tokens: int) -> Path:
    return Path(runs) / f"{model}-lr{lr:g}-seed{seed}-{tokens}"


def train_one(model: str, v: Variant, lr: float, seed: int, tokens: int, data, runs: Path, threads: int,
              phase: str) -> list[dict]:
    """Train ``model`` (``v``) at peak rate ``lr`` from ``seed`` for ``tokens`` tokens in its run
    directory (resuming a stopped run there); its rows, one per evaluation reading."""
    from fractus.training.registry import load_model  # in the worker process
    from fractus.training.runs import clear_unstarted, read_metrics
    from fractus.training.command import train
    out = run_dir(runs, model, lr, seed, tokens)
    clear_unstarted(out)  # nothing to resume before the first checkpoint: the run starts again
    argv = v.argv(data, out, tokens, seed, threads)
    argv[argv.index("--ckpt-every") + 1] = "200"
    argv += ["--lr", repr(lr)] + (["--resume"] if (out / "ckpt.pt").exists() else [])
    t0 = time.perf_counter()
    last = train(argv)  # its final validation (a run that had finished is validated again)
    wall = time.perf_counter() - t0
    params = load_model(out / "ckpt.pt").num_params()
    end = read_metrics(out / "metrics.csv")[-1]  # the run's last step, however many sessions it took
    tokens, elapsed = int(end["tokens"]), float(end["elapsed_s"])
    base = {"model": model, "preset": v.preset, "params": params, "tokens": tokens, "lr": lr, "seed": seed}
    timing = {"wall_s": wall, "tok_s": tokens / elapsed, "threads": threads, "phase": phase}
    readings = {headline_reading(model): ""} | ({"chunks": "_chunks"} if v.model == "transformer" else {})
    return [{**base, "eval": name, "val_ce": last[f"val_ce{sfx}"], "val_bpb": last[f"val_bpb{sfx}"],
             "val_ppl": last[f"val_ppl{sfx}"], **timing} for name, sfx in readings.items()]


def _key(model, lr, seed, tokens) -> tuple:
    return model, float(f"{float(lr):g}"), int(seed), int(tokens)


RUN_KEY = ("model", "lr", "seed", "tokens")  # a run's rows in the CSV


def read_rows(csv) -> pd.DataFrame:
    """The comparison's rows in ``csv`` (none if absent); ValueError unless it is the comparison's CSV."""
    return runner.read_results(csv, COLUMNS, "the comparison")


def done_runs(csv: Path) -> set:
    """(model, lr, seed, tokens) of every run whose rows ``csv`` holds."""
    return {_key(r.model, r.lr, r.seed, r.tokens) for r in read_rows(csv).itertuples()}


def run(jobs: list[tuple], data, csv: Path, runs: Path, phase: str, workers: int = 2, threads: int = 1,
        log=print, models: dict | None = None) -> pd.DataFrame:
    """Train each (model, lr, seed, tokens) of ``jobs`` not yet in ``csv``, ``workers`` at a time of
    ``threads`` threads (``models``: name → :class:`Variant`, default :data:`MODELS`); each run's rows
    added to ``csv`` whole as it ends. Holds ``csv`` and ``runs`` while it trains; Ctrl-C stops the
    running runs (saved) and starts no other (:class:`.runner.Workers`). Returns ``csv``'s rows."""
    models = MODELS if models is None else models
    with runner.held(csv, runs):
        done = done_runs(csv)
        todo = [j for j in jobs if _key(j[0], j[1], j[2], trained_tokens(j[3])) not in done]
        if len(todo) < len(jobs):
            log(f"{len(jobs) - len(todo)} of {len(jobs)} runs kept from {csv}")
        with runner.Workers(workers) as pool:
            for m, lr, seed, tokens in todo:
                pool.submit(None, train_one, m, models[m], lr, seed, tokens, data, runs, threads, phase)
            for _, rows in pool.done():
                append_csv(csv, rows, replace=RUN_KEY)
                log("  ".join(f"{r['model']} lr {r['lr']:g} seed {r['seed']} {r['eval']}: {r['val_ce']:.4f}"
                              for r in rows) + f"  ({rows[0]['tok_s']:,.0f} tok/s)")
    return read_rows(csv)


def headline(rows: pd.DataFrame) -> pd.DataFrame:
    """Each run's row of its model's own reading (carried for the CTEs, sliding for the transformer)."""
    return rows[rows["eval"] == rows["model"].map(headline_reading)]


def best_lr(rows: pd.DataFrame, model: str, tokens: int = DEMO_TOKENS) -> float:
    """``model``'s rate of lowest mean headline CE over its runs of ``tokens`` tokens."""
    h = headline(rows)
    h = h[(h["model"] == model) & (h["tokens"] == trained_tokens(tokens))]
    if h.empty:
        raise ValueError(f"no {model} runs of {tokens:,} tokens to choose a learning rate from")
    return float(h.groupby("lr")["val_ce"].mean().idxmin())


def tuned_lr(rows: pd.DataFrame, model: str, tokens: int = DEMO_TOKENS) -> float:
    """``model``'s tuned rate at ``tokens`` tokens: of its rates run from the most seeds, the one of
    lowest mean headline CE. The sweep runs every rate from one seed and ``seeds`` its best from
    three, so this is the sweep's best unless a second rate was also run from as many seeds (the
    default CTE's 1.2e-2 and 6e-3) and does better on them."""
    h = headline(rows)
    h = h[(h["model"] == model) & (h["tokens"] == trained_tokens(tokens))]
    if h.empty:
        raise ValueError(f"no {model} runs of {tokens:,} tokens to choose a learning rate from")
    by_rate = h.groupby("lr")["val_ce"].agg(["mean", "count"])
    return float(by_rate.loc[by_rate["count"] == by_rate["count"].max(), "mean"].idxmin())


def phase_jobs(phase: str, rows: pd.DataFrame | None, models=None, lrs=None, seeds=SEEDS,
               demo_tokens: int = DEMO_TOKENS, budget_tokens: int = BUDGET_TOKENS,
               lr: float | None = None) -> list[tuple]:
    """The (model, lr, seed, tokens) runs of ``phase``; ``sweep`` runs each model at its rates
    (``lrs`` or :data:`LRS`, :data:`RATES` for a model not there), ``seeds`` takes each model's best
    rate from the sweep's rows (``rows``), ``budget`` its tuned rate (:func:`tuned_lr`), ``variants``
    trains each of :data:`VARIANTS` at ``lr`` (default: the default CTE's sweep's best). ``models``:
    the phase's models (default: the three of :data:`MODELS`; for ``variants``, every variant)."""
    if phase == "variants" and models is not None and set(models) - set(VARIANTS):
        raise ValueError(f"variants trains variants: {sorted(set(models) - set(VARIANTS))} are not among "
                         f"{list(VARIANTS)}")
    models = tuple(models) if models is not None else (tuple(VARIANTS) if phase == "variants" else tuple(MODELS))
    if phase == "sweep":  # rates from the middle out, so that the first finished runs say the most
        rates = {m: (lrs or LRS).get(m, RATES) for m in models}
        jobs = [(abs(i - (len(rates[m]) - 1) / 2), (m, lr, seeds[0], demo_tokens))
                for m in models for i, lr in enumerate(rates[m])]
        return [j for _, j in sorted(jobs, key=lambda dj: dj[0])]
    if rows is None:
        raise ValueError(f"phase {phase} needs the sweep's rows: run the sweep first")
    if phase == "variants":
        lr = best_lr(rows[rows["phase"] == "sweep"], "default", demo_tokens) if lr is None else lr
        return [(m, lr, seeds[0], demo_tokens) for m in models]
    best = {m: best_lr(rows[rows["phase"] == "sweep"], m, demo_tokens) for m in models}
    if phase == "seeds":
        return [(m, best[m], s, demo_tokens) for s in seeds for m in models]
    if phase == "budget":
        return [(m, tuned_lr(rows, m, demo_tokens), seeds[0], budget_tokens) for m in models]
    raise ValueError(f"unknown phase {phase!r}: sweep, seeds, budget or variants")


def timing(names, data, steps: int = 60, rounds: int = 3, threads: int = 2, models: dict | None = None,
           log=print) -> pd.DataFrame:
    """Training throughput of each model in ``names``, measured in this one process on ``threads``
    threads, the models taking turns for ``rounds`` rounds of ``steps`` optimizer steps each (so a
    busy or throttled machine slows them alike): rows {model, round, tok_s} with tok_s the median
    over a round's steps after its first five (one step's tokens over its seconds)."""
    import tempfile

    import torch

    from fractus.training.runs import read_metrics
    from fractus.training.command import train
    models = {**MODELS, **VARIANTS} if models is None else models
    before = torch.get_num_threads()
    rows = []
    try:
        for r in range(rounds):
            for name in names:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "run"
                    argv = models[name].argv(data, out, steps * STEP_TOKENS, 0, threads)
                    train([*argv, "--no-progress"])
                    tok_s = [float(m["tok_s"]) for m in read_metrics(out / "metrics.csv")][5:]
                rows.append({"model": name, "round": r, "steps": steps, "threads": threads,
                             "tok_s": float(pd.Series(tok_s).median())})
                log(f"round {r} {name:48s} {rows[-1]['tok_s']:,.0f} tok/s")
    finally:
        torch.set_num_threads(before)
    return pd.DataFrame(rows)


def summary(rows: pd.DataFrame, tokens: int = DEMO_TOKENS) -> pd.DataFrame:
    """Per model (the three models first, then the variants tried) at ``tokens``, at its tuned rate
    (:func:`tuned_lr`): headline CE mean, min, max over seeds, bits/byte, training tok/s, and the
    mean CE and time against the transformer's."""
    h = headline(rows)
    h = h[h["tokens"] == trained_tokens(tokens)]
    names = [m for m in MODELS if (h["model"] == m).any()] + sorted(set(h["model"]) - set(MODELS))
    out = []
    for m in names:
        lr = tuned_lr(rows, m, tokens)
        g = h[(h["model"] == m) & (h["lr"] == lr)]
        out.append({"model": m, "lr": lr, "rates": h.loc[h["model"] == m, "lr"].nunique(), "seeds": g["seed"].nunique(),
                    "val_ce": g["val_ce"].mean(), "val_ce_min": g["val_ce"].min(), "val_ce_max": g["val_ce"].max(),
                    "val_bpb": g["val_bpb"].mean(), "tok_s": g["tok_s"].mean(),
                    "train_s": (g["tokens"] / g["tok_s"]).mean()})
    t = pd.DataFrame(out).set_index("model")
    if "transformer" in t.index:
        t["ce_vs_transformer"] = t["val_ce"] - t.loc["transformer", "val_ce"]
        t["time_vs_transformer"] = t["train_s"] / t.loc["transformer", "train_s"]
    return t


def plot_sweep(rows: pd.DataFrame, path, tokens: int = DEMO_TOKENS) -> Path:
    """Validation CE (each model's own reading, the mean over seeds) against the peak rate: a line
    for each model trained at several rates, a point for a variant tried at one; written to
    ``path`` with its provenance."""
    import matplotlib.pyplot as plt

    from fractus.bench.report import save_figure
    h = headline(rows)
    h = h[h["tokens"] == trained_tokens(tokens)]
    fig, ax = plt.subplots(figsize=(8, 6.2))
    names = [m for m in MODELS if (h["model"] == m).any()] + sorted(set(h["model"]) - set(MODELS))
    for i, m in enumerate(names):
        g = h[h["model"] == m].groupby("lr")["val_ce"].mean()
        ax.semilogx(g.index, g.values, "o-" if len(g) > 1 else "x", ms=6 if len(g) > 1 else 8,
                    color=plt.cm.tab20(i % 20), label=f"{m} ({headline_reading(m)})")
    ax.set_xlabel("peak learning rate (AdamW)")
    ax.set_ylabel("validation CE (nats/token)")
    ax.set_title(f"palier0 size, {tokens / 1e6:g} M tokens, mean over seeds")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    return save_figure(fig, path, note="results/compare_cpu.csv")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.experiments.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("sweep", "seeds", "budget", "variants", "timing"))
    ap.add_argument("--lr", type=float, default=None, help="variants: the rate they train at (default: the default "
                                                              "CTE's best of the sweep)")
    ap.add_argument("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    ap.add_argument("--csv", default="results/compare_cpu.csv")
    ap.add_argument("--runs", default="runs/compare", help="the runs' directories (kept for resuming)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timing-csv", default="results/compare_timing_cpu.csv",
                    help="timing: the CSV its rows go to (replaced)")
    ap.add_argument("--models", nargs="*", default=None, help="the models of the phase, from the three and the "
                                                               "variants (default: the three; timing: all)")
    a = ap.parse_args(argv)
    unknown = [m for m in a.models or () if m not in {**MODELS, **VARIANTS}]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the models: {[*MODELS, *VARIANTS]}")

    def body():
        if a.phase == "timing":
            t = timing(a.models or [*MODELS, *VARIANTS], a.data)
            write_csv(a.timing_csv, t.to_dict("records"))
            print(t.groupby("model", sort=False)["tok_s"].median().to_string())
            return
        rows = read_rows(a.csv)
        jobs = phase_jobs(a.phase, rows if len(rows) else None, lr=a.lr, **({"models": a.models} if a.models else {}))
        rows = run(jobs, a.data, Path(a.csv), Path(a.runs), a.phase, a.workers, models={**MODELS, **VARIANTS})
        print(summary(rows).to_string(float_format=lambda x: f"{x:.4g}"))
    runner.main(body)


if __name__ == "__main__":
    main()
