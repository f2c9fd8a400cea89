"""What the carried state remembers: context by position, resets, and associative recall.

Three measurements, each for the CTE models and the Transformer++ (notebook ``08_memory``):

- :func:`ce_by_position`: validation CE by position since a cold start, in log-spaced buckets:
  within the transformer's context on every window of the split (the same tokens for every
  model), beyond it on contiguous streams read with the state carried (the CTE);
- :func:`ce_with_resets`: validation CE with the state started afresh every R tokens against the
  state carried through each stream;
- multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): :func:`mqar` writes
  sequences of key–value pairs followed by queries of the keys; :func:`train_recall` trains a model
  on them and scores its accuracy on held-out sequences at the queried positions only.

Shapes: B sequences, T positions, V vocabulary.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from fractus.baseline import Transformer, TransformerConfig
from fractus.data import TokenStreams
from fractus.model import FractusConfig, FractusCTE
from fractus.records import append_csv
from fractus.train import lr_lambda, make_optimizer

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
# then scored on each setting of a grid: pairs D at T = 256, and lengths T at D = 16 (T = 512 is
# longer than any training sequence).
TRAIN_MIX = ((64, 4), (128, 8), (256, 16))
TEST_GRID = ((256, 4), (256, 8), (256, 16), (256, 32), (256, 64), (64, 16), (128, 16), (512, 16))


def train_recall(recall_model: RecallModel, lr: float, seed: int, d_model: int = 64, n_layers: int = 2,
                 vocab: int = 256, steps: int = 1500, batch: int = 32, n_test: int = 500,
                 mix=TRAIN_MIX, tests=TEST_GRID) -> list[dict]:
    """Train ``recall_model`` on fresh MQAR batches (``steps`` AdamW steps of ``batch`` sequences, the
    settings of ``mix`` taking turns; warm-up then cosine) and score it on ``n_test`` held-out
    sequences of each (seq_len, pairs) of ``tests``: the fraction of queried values predicted exactly
    (argmax). Returns a row per test setting with the model's name, the rate, the seed, the
    accuracy, whether the setting was trained on, the last training CE and the training seconds."""
    torch.manual_seed(seed)
    model = recall_model.build(d_model, n_layers, vocab, max(t for t, _ in (*mix, *tests)))
    opt = make_optimizer(model, "adamw", lr, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, steps // 10), steps, 0.1))
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        seq_len, pairs = mix[step % len(mix)]
        x, y = mqar(batch, seq_len, pairs, vocab, seed=1_000_003 * seed + step + 1)
        _, parts, _ = model(x, None, y)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(parts["ce"].detach()))
    train_s = time.perf_counter() - t0
    run = {"model": recall_model.name, "d_model": d_model, "n_layers": n_layers, "vocab": vocab, "lr": lr,
           "seed": seed, "steps": steps, "batch": batch, "train_ce": float(np.mean(losses[-len(mix):])),
           "params": model.num_params(), "train_s": train_s}
    return [{**run, "seq_len": t, "pairs": d, "trained_on": (t, d) in mix,
             "accuracy": recall_accuracy(model, t, d, vocab, n_test)} for t, d in tests]


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


def _recall_job(args: tuple) -> list[dict]:
    name, lr, seed, kw = args
    torch.set_num_threads(1)
    return train_recall(RECALL_BY_NAME[name], lr, seed, **kw)


RECALL_KEY = ("model", "lr", "seed", "d_model", "steps")


def run_recall(jobs: list[tuple], csv, workers: int = 2, log=print, **kw) -> pd.DataFrame:
    """Train each (model name, lr, seed) of ``jobs`` not yet in ``csv`` (same d_model and steps),
    ``workers`` processes of one thread at a time; each run's rows (one per test setting) appended to
    ``csv`` with their provenance as it finishes (an interrupted grid resumes). Returns ``csv``'s rows."""
    kw = {"d_model": 64, "steps": 1500, **kw}
    done = set()
    if Path(csv).exists():
        d = pd.read_csv(csv)
        done = {tuple(r) for r in d[list(RECALL_KEY)].astype(str).itertuples(index=False)}
    todo = [j for j in jobs if tuple(map(str, (*j, kw["d_model"], kw["steps"]))) not in done]
    if len(todo) < len(jobs):
        log(f"{len(jobs) - len(todo)} of {len(jobs)} recall runs kept from {csv}")
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_recall_job, (*j, kw)) for j in todo]
        for fut in as_completed(futures):
            rows = fut.result()
            append_csv(csv, rows)
            r = rows[0]
            log(f"{r['model']:24s} lr {r['lr']:g} seed {r['seed']}: accuracy "
                + " ".join(f"{x['seq_len']}/{x['pairs']} {x['accuracy']:.2f}" for x in rows) + f" ({r['train_s']:.0f} s)")
    return pd.read_csv(csv)
