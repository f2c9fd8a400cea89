"""What the carried state remembers: context by position, resets, and associative recall.

Three measurements, each for the CTE models and the Transformer++ (notebook ``08_memory``):

- :func:`ce_by_position`: validation CE by position since a cold start, in log-spaced buckets:
  within the transformer's context on every window of the split (the same tokens for every
  model), beyond it on contiguous streams read with the state carried (the CTE);
- :func:`ce_with_resets`: validation CE with the state started afresh every R tokens against the
  state carried through each stream;
- multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): :func:`mqar` writes
  sequences of key–value pairs followed by queries of the keys; :func:`train_recall` trains a model
  on them and scores its accuracy on held-out sequences at the queried positions only;
  :func:`recall_grid` is the experiment (command ``grid``): the rate swept on seed 0 until each
  swept model's best is bracketed, every model from three seeds at its rate, three of them wider.

Shapes: B sequences, T positions, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from fractus.atomic import atomic_open
from fractus.baseline import Transformer, TransformerConfig
from fractus.cli import natural, number, positive_int, seed_number
from fractus.data import TokenStreams
from fractus.model import FractusConfig, FractusCTE
from fractus.experiments import runner
from fractus.experiments.convergence import ACCURACY_TOL, change_over_last, next_budget
from fractus.training.records import append_csv, provenance
from fractus.training.optim import lr_lambda, make_optimizer

BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096)  # lower edges of the position buckets (the last runs to the end)
RESETS = (16, 64, 256, 1024, 4096)  # state reset every R tokens


# -- the language model's context -------------------------------------------------------------
def token_losses(model, tokens, streams: int, chunk_len: int, carried: bool = True) -> torch.Tensor:
    """Per-token CE [streams, L] (L = the streams' whole chunks) of ``model`` reading ``tokens`` as
    ``streams`` contiguous streams of ``chunk_len``-token chunks, the state carried from chunk to
    chunk (``carried``) or each chunk read from an empty state."""
    was = model.training
    model.eval()
    s = TokenStreams(tokens, streams, chunk_len)
    out, state = [], None
    with torch.no_grad():
        for _ in range(s.chunks_per_epoch):
            x, y, _ = s.next()
            logits, _, state = model(x, state if carried else None)
            out.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape))
    model.train(was)
    return torch.cat(out, 1)


def window_losses(model, tokens, window: int, batch: int = 32) -> torch.Tensor:
    """Per-token CE [n, window] of ``model`` reading every one of the n = (len − 1) // window
    consecutive windows of ``tokens`` from an empty state, ``batch`` windows at a time."""
    was = model.training
    model.eval()
    n = (len(tokens) - 1) // window
    t = torch.as_tensor(np.asarray(tokens[:n * window + 1], dtype=np.int64))
    x, y = t[:-1].view(n, window), t[1:].view(n, window)
    out = []
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(x[i:i + batch])[0]
            out.append(F.cross_entropy(logits.flatten(0, 1).float(), y[i:i + batch].flatten(),
                                       reduction="none").view(-1, window))
    model.train(was)
    return torch.cat(out)


def ce_by_position(model, tokens, streams: int, chunk_len: int, window: int, buckets=BUCKETS) -> list[dict]:
    """Mean CE of the tokens in each position bucket since a cold start: rows {bucket_lo,
    bucket_hi, tokens, ce}. Positions below ``window`` (the transformer's context): every window of
    the split read from an empty state (:func:`window_losses`), the same tokens for every model;
    positions from ``window`` on (stateful models only): ``streams`` contiguous streams read in
    ``chunk_len``-token chunks, the state carried (:func:`token_losses`)."""
    short = window_losses(model, tokens, window)  # [n, window]
    if isinstance(model, Transformer):
        long = short.new_zeros(0, 0)
    else:
        long = token_losses(model, tokens, streams, chunk_len)[:, window:]  # [streams, L − window]
    rows = []
    for lo, hi in zip(buckets, (*buckets[1:], math.inf)):
        parts = [short[:, lo:min(hi, window)]] if lo < window else []
        if hi > window and long.numel():
            parts.append(long[:, max(lo, window) - window:hi - window if hi < math.inf else None])
        parts = [p.flatten() for p in parts if p.numel()]
        if parts:
            last = window if not long.numel() else window + long.shape[1]
            rows.append({"bucket_lo": lo, "bucket_hi": min(hi, last), "tokens": sum(len(p) for p in parts),
                         "ce": float(torch.cat(parts).mean())})
    return rows


def ce_with_resets(model, tokens, streams: int, chunk_len: int, resets=RESETS) -> list[dict]:
    """CE with the state started afresh every R tokens (chunks of R read from an empty state),
    and with the state carried through each stream (``reset`` None): rows {reset, ce}."""
    rows = [{"reset": None, "ce": float(token_losses(model, tokens, streams, chunk_len).mean())}]
    stream_len = (len(tokens) - 1) // streams
    for r in resets:
        if r <= stream_len:
            rows.append({"reset": r, "ce": float(token_losses(model, tokens, streams, r, carried=False).mean())})
    return rows


# -- multi-query associative recall -------------------------------------------------------------
def mqar(n: int, seq_len: int, pairs: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` MQAR sequences (x, y [n, seq_len] int64), drawn from ``seed`` alone.

    The vocabulary splits in three: token 0 (filler), keys [1, vocab/2), values [vocab/2, vocab).
    A sequence lists ``pairs`` distinct keys, each followed by its value (positions 0 … 2·pairs − 1),
    then queries each key once at a random later position, the rest filler. The target y is the
    next token where a key is queried (its value) and −100 (not scored) everywhere else."""
    half = vocab // 2
    if pairs < 1 or 2 * pairs + pairs > seq_len or pairs > half - 1:
        raise ValueError(f"{pairs} pairs do not fit {seq_len} positions and a vocabulary of {vocab}: need "
                         f"3·pairs ≤ seq_len and pairs < vocab/2")
    rng = np.random.default_rng(seed)
    x = np.zeros((n, seq_len), dtype=np.int64)
    y = np.full((n, seq_len), -100, dtype=np.int64)
    for i in range(n):
        keys = rng.choice(np.arange(1, half), size=pairs, replace=False)
        values = rng.integers(half, vocab, size=pairs)
        x[i, 0:2 * pairs:2], x[i, 1:2 * pairs:2] = keys, values
        where = 2 * pairs + rng.choice(seq_len - 2 * pairs, size=pairs, replace=False)
        x[i, where] = keys
        y[i, where] = values
    return torch.from_numpy(x), torch.from_numpy(y)


@dataclass(frozen=True)
class RecallModel:
    """A model of MQAR's grid: "cte" (a preset's switches at width ``d_model``, ``changes`` on
    top) or "transformer" (the Transformer++ at the same width and depth, ``changes`` to its config)."""
    name: str
    kind: str = "cte"
    preset: str = "palier0"
    changes: tuple = ()

    def build(self, d_model: int, n_layers: int, vocab: int, seq_len: int):
        if self.kind == "transformer":
            return Transformer(TransformerConfig(vocab_size=vocab, d_model=d_model, head_dim=32, n_layers=n_layers,
                                                 context=seq_len, **dict(self.changes)))
        heads = max(1, d_model // 64)
        return FractusCTE(FractusConfig.preset(self.preset, vocab_size=vocab, d_model=d_model, n_heads=heads,
                                               n_layers=n_layers, expert_d_ff=d_model, **dict(self.changes)))


RECALL_MODELS = (
    RecallModel("default"),
    RecallModel("transformer", kind="transformer"),
    RecallModel("transformer + short conv", kind="transformer", changes=(("short_conv", 4),)),
    RecallModel("original", preset="original-palier0"),
    RecallModel("default − short conv", changes=(("short_conv", 0),)),
    RecallModel("default − window", changes=(("attn_window", 0),)),
    RecallModel("default − decay gate", changes=(("decay_gate", False),)),
    RecallModel("default, no decay", changes=(("attn_decay", 1.0),)),
    RecallModel("default + delta rule", changes=(("attn_update", "delta"), ("attn_norm", "rms"))),
    RecallModel("default, one level", changes=(("n_levels", 1),)),
    RecallModel("default, linear router", changes=(("router", "linear"),)),
)
RECALL_BY_NAME = {m.name: m for m in RECALL_MODELS}

# Zoology's way: one model trained on a mixture of (seq_len, pairs) settings, batches taking turns,
# then scored on each setting of a grid: pairs D at T = 256, lengths T at D = 16 (T = 512 and 1,024
# are longer than any training sequence), and the settings that separate a fixed-size state from
# attention: 64 and 128 pairs at T = 512 and 1,024 (128 pairs need 384 positions: not at T = 256).
# The vocabulary holds 255 keys (and 256 values), so 128 distinct keys fit.
TRAIN_MIX = ((64, 4), (128, 8), (256, 16))
TEST_GRID = ((256, 4), (256, 8), (256, 16), (256, 32), (256, 64), (64, 16), (128, 16), (512, 16), (1024, 16),
             (512, 64), (1024, 64), (512, 128), (1024, 128))
VOCAB = 512
STEPS, MAX_STEPS = 6000, 24000  # the first budget; doubled while the curve has not settled, up to the ceiling
CURVE_POINTS = 24  # held-out points on a run's learning curve (every steps / 24)
PROBE_SEQUENCES = 200  # held-out sequences of the curve's setting (the mixture's last: T 256, D 16)


@dataclass
class RecallRun:
    """A trained recall model's rows (one per test setting) and its learning curve (one row per
    held-out point: step, mean training CE since the last point, probe accuracy)."""
    rows: list[dict]
    curve: list[dict]


def train_recall(recall_model: RecallModel, lr: float, seed: int, d_model: int = 64, n_layers: int = 2,
                 vocab: int = VOCAB, steps: int = STEPS, batch: int = 32, n_test: int = 500,
                 mix=TRAIN_MIX, tests=TEST_GRID, curve_points: int = CURVE_POINTS,
                 n_probe: int = PROBE_SEQUENCES, resume: str | Path | None = None) -> RecallRun:
    """Train ``recall_model`` on fresh MQAR batches (``steps`` AdamW steps of ``batch`` sequences, the
    settings of ``mix`` taking turns; warm-up then cosine) and score it on ``n_test`` held-out
    sequences of each (seq_len, pairs) of ``tests``: the fraction of queried values predicted exactly
    (argmax). Its learning curve scores ``n_probe`` held-out sequences of the mixture's last setting
    at ``curve_points`` evenly spaced steps; a row's ``probe_change`` is how far that accuracy moved
    over the last quarter of training and ``settled`` whether that is within the convergence rule's
    tolerance (:mod:`fractus.experiments.convergence`). A row per test setting carries the model's
    name, the rate, the seed, the accuracy, whether the setting was trained on, the last training CE
    and the training seconds (the curve's evaluations excluded).

    With ``resume`` (a file), the run's state is saved there (atomically) at each point of its
    curve, and a run stopped part-way continues from its last point: exactly, as each batch is drawn
    from its step's seed. The file is removed once the rows are scored; a file of another setting is
    a ValueError."""
    setting = json.dumps({"model": recall_model.name, "lr": lr, "seed": seed, "d_model": d_model,
                          "n_layers": n_layers, "vocab": vocab, "steps": steps, "batch": batch, "mix": mix,
                          "curve_points": curve_points, "n_probe": n_probe}, sort_keys=True)
    torch.manual_seed(seed)
    model = recall_model.build(d_model, n_layers, vocab, max(t for t, _ in (*mix, *tests)))
    opt = make_optimizer(model, "adamw", lr, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, steps // 10), steps, 0.1))
    points = sorted({max(1, round(steps * (i + 1) / curve_points)) for i in range(curve_points)})
    probe_len, probe_pairs = mix[-1]
    start, train_s, losses, curve = 0, 0.0, [], []
    if resume is not None and Path(resume).exists():
        saved = torch.load(resume, weights_only=True)
        if saved["setting"] != setting:
            raise ValueError(f"{resume} holds the resume point of another recall run ({saved['setting']}); "
                             "remove it or give another runs folder")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        start, train_s, losses, curve = saved["step"], saved["train_s"], saved["losses"], saved["curve"]
    for step in range(start, steps):
        t0 = time.perf_counter()
        seq_len, pairs = mix[step % len(mix)]
        x, y = mqar(batch, seq_len, pairs, vocab, seed=1_000_003 * seed + step + 1)
        _, parts, _ = model(x, None, y)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(parts["ce"].detach()))
        train_s += time.perf_counter() - t0
        if step + 1 in points:
            since = len(losses) - (curve[-1]["step"] if curve else 0)
            curve.append({"step": step + 1, "train_ce": float(np.mean(losses[-since:])),
                          "probe_accuracy": recall_accuracy(model, probe_len, probe_pairs, vocab, n_probe, seed=1)})
            if resume is not None and step + 1 < steps:
                with atomic_open(resume, "wb") as f:
                    torch.save({"setting": setting, "step": step + 1, "model": model.state_dict(),
                                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                "rng": torch.get_rng_state(), "train_s": train_s, "losses": losses,
                                "curve": curve}, f)
    change = change_over_last([c["step"] for c in curve], [c["probe_accuracy"] for c in curve])
    run = {"model": recall_model.name, "d_model": d_model, "n_layers": n_layers, "vocab": vocab, "lr": lr,
           "seed": seed, "steps": steps, "batch": batch, "train_ce": float(np.mean(losses[-len(mix):])),
           "params": model.num_params(), "train_s": train_s, "probe_change": change,
           "settled": bool(change <= ACCURACY_TOL)}
    rows = [{**run, "seq_len": t, "pairs": d, "trained_on": (t, d) in mix,
             "accuracy": recall_accuracy(model, t, d, vocab, n_test)} for t, d in tests]
    key = {k: run[k] for k in RECALL_KEY}
    if resume is not None:
        Path(resume).unlink(missing_ok=True)
    return RecallRun(rows, [{**key, **c} for c in curve])


@torch.no_grad()
def recall_accuracy(model, seq_len: int, pairs: int, vocab: int, n: int, seed: int = -1) -> float:
    """The fraction of the queried values ``model`` predicts (argmax) on ``n`` held-out sequences
    (drawn from a seed no training batch uses)."""
    was = model.training
    model.eval()
    x, y = mqar(n, seq_len, pairs, vocab, seed=2 ** 40 + (seed if seed >= 0 else 0))
    right = total = 0
    for i in range(0, n, 100):
        logits = model(x[i:i + 100])[0]
        scored = y[i:i + 100] != -100
        right += int((logits.argmax(-1)[scored] == y[i:i + 100][scored]).sum())
        total += int(scored.sum())
    model.train(was)
    return right / total


def _recall_job(name: str, lr: float, seed: int, kw: dict) -> RecallRun:
    torch.set_num_threads(1)
    run = train_recall(RECALL_BY_NAME[name], lr, seed, **kw)
    device = {"device": provenance()["device"]}  # where it trained: this worker's one thread
    return RecallRun([{**r, **device} for r in run.rows], [{**c, **device} for c in run.curve])


RECALL_KEY = ("model", "lr", "seed", "d_model", "vocab", "steps")  # a run's rows (and curve) in its CSV
RECALL_COLUMNS = (*RECALL_KEY, "settled", "probe_change", "seq_len", "pairs", "accuracy", "train_s")


def read_recall(csv) -> pd.DataFrame:
    """The recall runs' rows in ``csv`` (none if absent); ValueError unless it is the recall grid's CSV."""
    return runner.read_results(csv, RECALL_COLUMNS, "the recall grid")


def recall_budgets(csv) -> dict:
    """Of the recall runs in ``csv``: {(model, lr, seed, d_model, vocab): {steps: settled}}."""
    out: dict = {}
    for r in read_recall(csv).drop_duplicates(list(RECALL_KEY)).itertuples(index=False):
        out.setdefault((r.model, float(r.lr), int(r.seed), int(r.d_model), int(r.vocab)), {})[int(r.steps)] = bool(r.settled)
    return out


def pending_budget(done: dict, steps: int, max_steps: int) -> int | None:
    """The budget a run trains at next given its finished budgets ``done`` ({steps: settled}):
    ``steps`` first, then doubled while the last one has not settled, up to ``max_steps``."""
    budget = steps
    while budget in done:
        budget = next_budget(budget, done[budget], max_steps)
        if budget is None:
            return None
    return budget


def curves_path(csv) -> Path:
    """Where the learning curves of ``csv``'s runs go: ``recall_cpu.csv`` → ``recall_curves_cpu.csv``."""
    csv = Path(csv)
    stem = csv.stem[:-4] + "_curves_cpu" if csv.stem.endswith("_cpu") else csv.stem + "_curves"
    return csv.with_name(stem + csv.suffix)


def resume_path(runs, name: str, lr: float, seed: int, kw: dict) -> Path:
    """The resume point of a recall run in the folder ``runs``: one file per model, rate, seed,
    width, vocabulary and budget (``default_delta_rule-lr0.01-seed0-d64-v512-6000.pt``)."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")
    return Path(runs) / f"{slug}-lr{lr:g}-seed{seed}-d{kw['d_model']}-v{kw['vocab']}-{kw['steps']}.pt"


def run_recall(jobs: list[tuple], csv, curves_csv=None, workers: int = 2, log=print, max_steps: int | None = None,
               runs=None, **kw) -> pd.DataFrame:
    """Train each (model name, lr, seed) of ``jobs`` until its learning curve has settled: at
    ``steps``, then at twice the steps while the run has not settled, up to ``max_steps`` (default:
    ``steps``, one budget). ``workers`` processes of one thread at a time; each run's rows (one per
    test setting) are appended to ``csv`` whole, with their provenance, as it finishes — its curve
    to ``curves_csv`` (default: ``csv``'s name with ``_curves``) just before —, so an interrupted
    grid resumes. With a folder ``runs``, a run also saves its resume point there at each point of
    its curve (:func:`resume_path`), and one stopped part-way continues from it. Returns ``csv``'s rows."""
    kw = {"d_model": 64, "steps": STEPS, "vocab": VOCAB, **kw}
    steps = kw.pop("steps")
    max_steps = max(steps, max_steps or steps)
    csv = Path(csv)
    curves_csv = Path(curves_csv) if curves_csv else curves_path(csv)
    budgets: dict = {}

    def next_for(job):
        return pending_budget(budgets.get((job[0], float(job[1]), int(job[2]), kw["d_model"], kw["vocab"]), {}),
                              steps, max_steps)

    def submit(job, budget):
        args = {**kw, "steps": budget}
        if runs is not None:
            args["resume"] = resume_path(runs, *job, args)
        pool.submit(job, _recall_job, *job, args)

    with runner.held(csv, runs), runner.Workers(workers) as pool:
        budgets = recall_budgets(csv)
        runner.read_results(curves_csv, (*RECALL_KEY, "step", "probe_accuracy"), "the recall curves")
        todo = [(j, next_for(j)) for j in jobs]
        todo = [(j, b) for j, b in todo if b is not None]
        if len(todo) < len(jobs):
            log(f"{len(jobs) - len(todo)} of {len(jobs)} recall runs kept from {csv}")
        for j, b in todo:
            submit(j, b)
        for job, run in pool.done():
            # the curve first, then the rows that mark the run done: a run stopped between the two is
            # trained again, and its curve replaces the one written before
            append_csv(curves_csv, run.curve, replace=RECALL_KEY)
            append_csv(csv, run.rows, replace=RECALL_KEY)
            r = run.rows[0]
            budgets.setdefault((r["model"], float(r["lr"]), int(r["seed"]), r["d_model"], r["vocab"]), {})[
                r["steps"]] = r["settled"]
            log(f"{r['model']:24s} lr {r['lr']:g} seed {r['seed']} {r['steps']} steps"
                f" ({'settled' if r['settled'] else 'not settled'}, {r['probe_change']:.3f}): accuracy "
                + " ".join(f"{x['seq_len']}/{x['pairs']} {x['accuracy']:.2f}" for x in run.rows)
                + f" ({r['train_s']:.0f} s)")
            budget = next_for(job)
            if budget is not None:
                submit(job, budget)
    return read_recall(csv)


def settled_reading(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows a reading takes: of each (model, lr, seed, d_model, vocab), the run at its largest
    budget (the settled one, unless the ceiling came first: its ``settled`` says so)."""
    group = ["model", "lr", "seed", "d_model", "vocab"]
    last = rows.groupby(group)["steps"].transform("max")
    return rows[rows["steps"] == last]


SWEEP_RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # half-decade steps
SWEEP_START = (1e-2, 3e-2)


def sweep_score(rows: pd.DataFrame) -> pd.Series:
    """A rate's score in the sweep: the mean accuracy over every setting of the grid, of the run at
    its last budget, by rate (``rows``: one model's rows, one seed)."""
    return settled_reading(rows).groupby("lr")["accuracy"].mean()


def left_chance(rows: pd.DataFrame) -> pd.Series:
    """Whether each rate's run has learnt the task at all, by rate (``rows``: one model's rows, one
    seed, each run at its last budget): its accuracy on every setting it was trained on is at least
    twice the chance of naming one of the D values in the context (2 / D). A flat curve at chance
    passes the convergence rule; this tells it apart from a task learnt."""
    if rows.empty:
        return pd.Series(dtype=bool)
    read = settled_reading(rows)
    trained = read[read["trained_on"]] if read["trained_on"].any() else read
    return (trained["accuracy"] >= 2 / trained["pairs"]).groupby(trained["lr"]).all()


def _rank(scores: dict, learnt: dict):
    """The order of rates in a sweep: a run that left chance above one that did not, then the
    higher score, then (a tie) the lower rate."""
    return lambda r: (learnt.get(r, True), scores[r], -r)


def next_rate(scores: dict, rates=SWEEP_RATES, start=SWEEP_START, learnt: dict | None = None) -> float | None:
    """The rate a sweep tries next, given the ``scores`` ({rate: score}) of those tried and whether
    each one's run left chance (``learnt``: {rate: bool}, :func:`left_chance`; a rate missing
    counts as learnt): the rates of ``start`` first — except one above a rate at which the model
    did not learn the task (a rate too high to learn at is not made higher) — then the untried
    neighbour on ``rates``' grid of the best so far (the lower one first; a run that did not learn
    ranks below every run that did), until the best has a tried neighbour on each side (or the
    grid's end): None then. So the sweep stops once its best is bracketed by two worse rates,
    without the far ends."""
    scores = {r: v for r, v in scores.items() if r in rates}
    learnt = learnt or {}
    failed = [r for r in scores if not learnt.get(r, True)]
    for r in start:
        if r not in scores and not any(r > f for f in failed):
            return r
    best = rates.index(max(scores, key=_rank(scores, learnt)))
    for i in (best - 1, best + 1):
        if 0 <= i < len(rates) and rates[i] not in scores:
            return rates[i]
    return None


def swept_rate(rows: pd.DataFrame, rates=SWEEP_RATES) -> float:
    """The sweep's best rate for one model's seed-0 ``rows`` (:func:`sweep_score`, :func:`left_chance`)."""
    rows = rows[rows["lr"].isin(rates)]
    scores, learnt = sweep_score(rows).to_dict(), left_chance(rows).to_dict()
    return float(max(scores, key=_rank(scores, learnt)))


# the models whose rate is swept (the others borrow the default's while they leave chance at it), and
# those also trained wider
SWEPT = ("default", "default + delta rule", "transformer + short conv", "transformer")
WIDENED = ("default", "default + delta rule", "transformer + short conv")


def _first_budget(rows: pd.DataFrame, model: str, kw: dict) -> pd.DataFrame:
    """``model``'s seed-0 runs at the first budget (the sweep's), at ``kw``'s width and vocabulary."""
    width, vocab, steps = kw.get("d_model", 64), kw.get("vocab", VOCAB), kw.get("steps", STEPS)
    return rows[(rows["model"] == model) & (rows["seed"] == 0) & (rows["d_model"] == width)
                & (rows["vocab"] == vocab) & (rows["steps"] == steps)]


def sweep(models, csv, rates=SWEEP_RATES, start=SWEEP_START, **kw) -> dict:
    """Sweep each of ``models``' rate on seed 0 (:func:`next_rate`) at the first budget (``steps``:
    the rates compared on the same steps, none trained longer for the sweep), training the runs not
    yet in ``csv`` (:func:`run_recall`, ``kw``); returns {model: its best rate} (:func:`swept_rate`)."""
    def propose(rows):
        return next_rate(sweep_score(rows).to_dict(), rates, start, left_chance(rows).to_dict())

    while True:
        rows = read_recall(csv)
        todo = [(m, r, 0) for m in models if (r := propose(_first_budget(rows, m, kw))) is not None]
        if not todo:
            return {m: swept_rate(_first_budget(rows, m, kw), rates) for m in models}
        run_recall(todo, csv, **{**kw, "max_steps": kw.get("steps", STEPS)})


def recall_grid(csv, models=tuple(RECALL_BY_NAME), seeds=(0, 1, 2), wide: int | None = 128, swept=SWEPT,
                widened=WIDENED, rates=SWEEP_RATES, start=SWEEP_START, **kw) -> dict:
    """The recall experiment: the rate of each model of ``swept`` swept on seed 0 at the first
    budget (:func:`sweep`); every other model of ``models`` borrows the default's, unless its run
    from seed 0 there does not leave chance (:func:`left_chance`): then its rate is swept from the
    default's. Then every model from ``seeds`` at its rate, each run trained until it settles
    (:func:`run_recall`), the swept ones first; then those of ``widened`` at width ``wide`` (None:
    not) at the rate swept at the first width. Trains what ``csv`` lacks (``kw``:
    :func:`run_recall`'s; ``max_steps`` :data:`MAX_STEPS` unless given); returns {model: rate}."""
    kw = {"max_steps": MAX_STEPS, **kw}  # a run not settled trains again at twice the steps, up to this
    swept = [m for m in swept if m in models]
    best = sweep(swept, csv, rates, start, **kw)
    borrowing = [m for m in models if m not in best]
    if borrowing and "default" not in best:
        raise ValueError(f"{borrowing} train at the default's rate: sweep the default too")
    stuck = []
    if borrowing:
        rate = best["default"]
        run_recall([(m, rate, 0) for m in borrowing], csv, **{**kw, "max_steps": kw.get("steps", STEPS)})
        rows = read_recall(csv)
        stuck = [m for m in borrowing if not left_chance(_first_budget(rows, m, kw)).get(rate, True)]
        best |= sweep(stuck, csv, rates, (rate,), **kw) | {m: rate for m in borrowing if m not in stuck}
    order = swept + stuck + [m for m in borrowing if m not in stuck]
    run_recall([(m, best[m], s) for m in order for s in seeds], csv, **kw)
    if wide:
        run_recall([(m, best[m], s) for m in widened if m in models for s in seeds], csv, **{**kw, "d_model": wide})
    return best


def lead(rows: pd.DataFrame, model: str, over: str) -> pd.DataFrame:
    """How far ``model`` recalls ahead of ``over``, setting by setting, against the spread over seeds
    (``rows``: each run once, as :func:`settled_reading` gives them, one width). Per (T, D) that
    both were scored at: each model's mean accuracy over its seeds and its spread (max − min), the
    lead (``model``'s mean minus ``over``'s) and ``beyond``: whether the lead exceeds the larger of
    the two spreads — a difference the seeds alone do not make; never from fewer than two seeds each
    (no spread to judge by)."""
    def by(m):
        return rows[rows["model"] == m].groupby(["seq_len", "pairs"])["accuracy"].agg(["mean", "min", "max", "count"])
    a, b = by(model), by(over)
    if a.empty or b.empty:
        raise ValueError(f"no rows of {model if a.empty else over!r} to compare")
    t = a.add_suffix("_a").join(b.add_suffix("_b"), how="inner")
    out = pd.DataFrame({model: t["mean_a"], over: t["mean_b"], "lead": t["mean_a"] - t["mean_b"],
                        "spread": np.maximum(t["max_a"] - t["min_a"], t["max_b"] - t["min_b"]),
                        "seeds": np.minimum(t["count_a"], t["count_b"])})
    out["beyond"] = (out["lead"].abs() > out["spread"]) & (out["seeds"] >= 2)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.experiments.memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("recall", help="train and score MQAR models until their curves settle")
    r.add_argument("--models", nargs="+", default=["default"], help=f"from {list(RECALL_BY_NAME)}")
    r.add_argument("--lrs", nargs="+", type=number(float, lambda x: x > 0, "> 0"), default=[3e-2])
    r.add_argument("--seeds", nargs="+", type=seed_number, default=[0])
    r.add_argument("--steps", type=positive_int, default=STEPS, help="the first budget")
    r.add_argument("--max-steps", type=positive_int, default=MAX_STEPS, help="the ceiling of the doubled budgets")
    r.add_argument("--d-model", type=positive_int, default=64)
    g = sub.add_parser("grid", help="the whole experiment: each swept model's rate bracketed on seed 0, every "
                                    "model from each seed at its rate, three of them wider")
    g.add_argument("--models", nargs="+", default=list(RECALL_BY_NAME), help=f"from {list(RECALL_BY_NAME)}")
    g.add_argument("--seeds", nargs="+", type=seed_number, default=[0, 1, 2])
    g.add_argument("--wide", type=natural, default=128,
                   help="the width the swept models are trained at too (0: none)")
    for cmd in (r, g):
        cmd.add_argument("--workers", type=positive_int, default=1, help="processes of one thread each")
        cmd.add_argument("--csv", default="results/recall_cpu.csv")
        cmd.add_argument("--runs", default="runs/recall", help="the runs' resume points (a stopped run continues)")
    a = ap.parse_args(argv)
    unknown = [m for m in a.models if m not in RECALL_BY_NAME]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the models: {list(RECALL_BY_NAME)}")
    if a.command == "grid":
        body = lambda: recall_grid(a.csv, a.models, a.seeds, a.wide or None, workers=a.workers, runs=a.runs,
                                   log=lambda s: print(s, flush=True))
    else:
        jobs = [(m, lr, s) for m in a.models for lr in a.lrs for s in a.seeds]
        body = lambda: run_recall(jobs, a.csv, workers=a.workers, steps=a.steps, max_steps=a.max_steps,
                                  d_model=a.d_model, runs=a.runs)
    runner.main(body, interrupted="interrupted: finished runs are in the CSV; a stopped one continues from its "
                                  "last resume point")


if __name__ == "__main__":
    main()
