"""TRAINING_OPTIMIZATION.md's training optimizations, measured: speed, peak memory and learning.

The set-ups are :class:`fractus.bench.setup.Setup` (one training configuration: model switches +
trainer switches) and the optimization stack of :mod:`fractus.bench.optimizations` (the document's
optimizations and claims as data, :func:`stack`, :func:`alone`, :func:`toggles`), which the GPU
suite times too; they are importable from here, beside the measurements that take them, so that a
notebook reads one module. For each setup this module measures

- speed: tokens/s of the trainer's own optimizer steps on random tokens
  (:func:`fractus.bench.optimizations.measure_speed`), in interleaved rounds (:func:`measure_speeds`),
  always as a ratio to a baseline measured in the same run (:func:`speedup`);
- peak memory of a first optimizer step (activations, gradients, optimizer state) in a fresh
  process (:func:`peak_bytes`);
- quality: validation cross-entropy (and bits per byte, which compares across vocabularies)
  after the same number of training tokens of the Shakespeare corpus (:func:`short_train`),
  from several seeds (:func:`train_many`); an optimization's cost is the per-seed difference
  with and without it (:func:`quality_cost`).

The notebook ``02_optimization_table`` drives it.
"""
from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from fractus.bench.common import cpu_peak_bytes, cuda_peak_bytes
# the stack and SMOKE_DIMS are not used here: imported for the notebooks (see the module's docstring)
from fractus.bench.optimizations import (ALONE_EXTRA, EXPECTED, OPTIMIZATIONS, alone, bf16_gain,  # noqa: F401
                                         measure_speed, stack, toggles)
from fractus.bench.setup import SMOKE_DIMS, Setup  # noqa: F401
from fractus.bench.throughput import random_batches
from fractus.data import TokenStreams, load_meta, load_tokens, prepare
from fractus.model import FractusCTE
from fractus.training.records import REPO
from fractus.tokenizer import get_tokenizer, token_byte_lengths
from fractus.training.evaluation import evaluate_text
from fractus.training.optim import lr_lambda, make_optimizer
from fractus.training.steps import micro_steps, set_active_blocks

DATA_NAMES = {8192: "shakespeare-8k", 50257: "shakespeare-50k"}


def shakespeare(vocab_size: int) -> Path:
    """``data/shakespeare-8k`` / ``-50k`` (the embedded corpus tokenized at ``vocab_size``),
    prepared when missing."""
    out = REPO / "data" / DATA_NAMES.get(vocab_size, f"shakespeare-v{vocab_size}")
    if not (out / "meta.json").exists():
        prepare("shakespeare", out, vocab_size)
    meta = load_meta(out)
    if meta["vocab_size"] != vocab_size:
        raise ValueError(f"{out} holds vocabulary {meta['vocab_size']}, expected {vocab_size}")
    return out


# TRAINING_OPTIMIZATION.md's combined table: baseline 4 tok/s; the first 7 of OPTIMIZATIONS, through SGD: ~177x
# (707 tok/s); + B=8: ~4x (1345 tok/s), ~336x in all. Its own tok/s make the B=8 step
# 1345 / 707 = 1.9x, not ~4x.
ORIGINAL_COMBINED = {"baseline_tok_s": 4.0, "through_sgd": 177.0, "through_sgd_tok_s": 707.0,
                     "with_batch_8": 336.0, "with_batch_8_tok_s": 1345.0}
# TRAINING_OPTIMIZATION.md's bf16 autocast optimization (GPU only, section 9): its claim, on a part of the step.
BF16_CLAIM = "~2x on all matmuls, halves memory"
# TRAINING_OPTIMIZATION.md's batch table (section 8): tok/s per batch size, "d=128, 2 blocks"; the rest of its
# setting is not stated, and its B=1 figure is not the 707 tok/s of its combined table.
ORIGINAL_BATCH_TOK_S = {1: 335, 2: 598, 4: 894, 8: 1345}


# -------------------------------------------------------------------------------- speed
def measure_speeds(setups, rounds: int = 3, seed: int = 0, **kw) -> dict[Setup, list[float]]:
    """tok/s of each setup in ``rounds`` interleaved rounds (:func:`measure_speed`, ``kw``):
    every setup once per round, in an order shuffled per round (none always first, as after a
    cold start), so a drift of the machine reaches all of them alike and a ratio can be taken
    round by round (:func:`speedup`). ``out[setup][i]`` is round i's."""
    setups = list(dict.fromkeys(setups))
    out = {r: [] for r in setups}
    rng = random.Random(seed)
    for _ in range(rounds):
        for r in rng.sample(setups, len(setups)):
            out[r].append(measure_speed(r, **kw)["tok_s"])
    return out


def rounds_rows(tok_s: dict[Setup, list[float]], names: dict[Setup, str]) -> list[dict]:
    """The raw rounds as rows {setup, round, tok_s} (for a CSV beside the table they make)."""
    return [{"setup": names[r], "round": i, "tok_s": t} for r, ts in tok_s.items() for i, t in enumerate(ts)]


AS_CLAIMED = "as claimed (within 1.25x either way)"


def verdict(measured: float, claimed: float) -> str:
    """A measured speedup against the document's claimed one: no gain (≤ 1x where a gain was
    claimed), as claimed (within 1.25x either way), or smaller / larger than claimed."""
    ratio = measured / claimed
    return ("no gain measured (a gain was claimed)" if measured <= 1 < claimed else
            AS_CLAIMED if 0.8 <= ratio <= 1.25 else
            "smaller than claimed" if ratio < 0.8 else "larger than claimed")


LEARNS_LESS, LEARNS_MORE, NO_EFFECT, SMALL_EFFECT = "learns less", "learns more", "no measurable effect", "small effect"
SEED_NOISE = "not separated from seed noise"
LEARNS_LESS_BPB, NO_EFFECT_BPB = 0.02, 0.005  # the bands' edges in Δ bits per byte


def quality_effect(dbpb: Sequence[float]) -> str:
    """An optimization's quality cost from its Δbpb per seed (validation bits per byte with the
    optimization minus without, after the same tokens, both runs from the same seed). On the mean: no
    measurable effect within ± NO_EFFECT_BPB; otherwise, when the seeds disagree in sign, not
    separated from seed noise; else learns less above +LEARNS_LESS_BPB, more below
    −LEARNS_LESS_BPB, and a small effect between. ValueError on NaN or no seed."""
    d = np.asarray(dbpb, dtype=float)
    if d.size == 0 or np.isnan(d).any():
        raise ValueError(f"no quality cost measured ({d.tolist()})")
    mean = float(d.mean())
    if abs(mean) < NO_EFFECT_BPB:
        return NO_EFFECT
    if d.min() <= 0 <= d.max():
        return SEED_NOISE
    return LEARNS_LESS if mean > LEARNS_LESS_BPB else LEARNS_MORE if mean < -LEARNS_LESS_BPB else SMALL_EFFECT


def quality_cost(with_runs: list[dict], without_runs: list[dict]) -> dict:
    """Quality with an optimization against without, from :func:`train_many`'s runs of the same seeds:
    the means of val_ce and val_bpb over the seeds, Δbpb (with − without) as its mean and its
    lowest and highest over the seeds, and its :func:`quality_effect`."""
    if len(with_runs) != len(without_runs) or not with_runs:
        raise ValueError(f"{len(with_runs)} runs with the optimization against {len(without_runs)} without")
    d = [w["val_bpb"] - wo["val_bpb"] for w, wo in zip(with_runs, without_runs)]
    mean = {f"{k} {side}": float(np.mean([r[k] for r in runs])) for k in ("val_ce", "val_bpb")
            for side, runs in (("with", with_runs), ("without", without_runs))}
    return {**mean, "quality cost (Δbpb)": float(np.mean(d)), "Δbpb low": min(d), "Δbpb high": max(d),
            "quality effect": quality_effect(d)}


def speedup(tok_s: dict[Setup, list[float]], new: Setup, old: Setup) -> dict:
    """``new``'s tok/s over ``old``'s, round by round: the median ratio and the lowest and
    highest (the spread a single measurement would hide)."""
    ratios = np.asarray(tok_s[new]) / np.asarray(tok_s[old])
    return {"median": float(np.median(ratios)), "low": float(ratios.min()), "high": float(ratios.max())}


def compile_effect(setup: Setup, min_tokens: int = 4096, min_steps: int = 3) -> dict:
    """torch.compile on ``setup`` (CPU): eager tok/s, then one compiled model that first checks
    it computes the same loss as the eager model on a batch (relative difference), then is
    timed like :func:`measure_speed`; the compile time is the first two steps' (and the check's)
    wall time beyond two steady steps."""
    eager = measure_speed(setup, min_tokens, min_steps)
    torch.manual_seed(0)
    model = FractusCTE(setup.config())
    opt = make_optimizer(model, setup.optimizer, setup.lr(), 0.0)
    fwd = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    device = torch.device("cpu")

    def batches():
        return random_batches(g, model.cfg.vocab_size, setup.batch_size, setup.chunk_len, setup.accum)

    x, y, _ = next(batches())
    t0 = time.perf_counter()
    loss_c = fwd(x, None, y, setup.head_positions)[1]["loss"].item()
    loss_e = model(x, None, y, setup.head_positions)[1]["loss"].item()
    steps = max(min_steps, math.ceil(min_tokens / setup.tokens_per_step()))
    state, times = None, []
    for i in range(2 + steps):
        t1 = time.perf_counter()
        _, _, state, _ = micro_steps(fwd, batches(), state, setup.accum, setup.head_positions, device, False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t1)
        if i == 1:
            first = time.perf_counter() - t0
    step_s = sorted(times[2:])[len(times[2:]) // 2]
    tok_s = setup.tokens_per_step() / step_s
    return {"eager_tok_s": eager["tok_s"], "compiled_tok_s": tok_s, "speedup": tok_s / eager["tok_s"],
            "compile_s": first - 2 * step_s, "loss_rel_diff": abs(loss_c - loss_e) / abs(loss_e)}


def setup_step_thunk(device: str = "cpu", **fields):
    """Build ``Setup(**fields)``'s model and optimizer; return a thunk running one optimizer step."""
    setup = Setup(**{k: tuple(map(tuple, v)) if k == "dims" else v for k, v in fields.items()})
    device = torch.device(device)
    torch.manual_seed(0)
    model = FractusCTE(setup.config()).to(device)
    opt = make_optimizer(model, setup.optimizer, setup.lr(), 0.01)
    if setup.active_blocks:
        set_active_blocks(model, setup.active_blocks, 0, 0)
    g = torch.Generator().manual_seed(0)

    def run():
        batches = random_batches(g, model.cfg.vocab_size, setup.batch_size, setup.chunk_len, setup.accum)
        micro_steps(model, batches, None, setup.accum, setup.head_positions, device, False)
        opt.step()
    return run


def peak_bytes(setup: Setup, device: str = "cpu") -> int:
    """Peak memory of a first optimizer step above the built model (fresh process on CPU)."""
    fields = {k: v for k, v in asdict(setup).items() if k not in ("compile", "reduced_vocab")}
    if torch.device(device).type == "cuda":
        return cuda_peak_bytes(setup_step_thunk(device=device, **fields))
    return cpu_peak_bytes("fractus.experiments.optimizations:setup_step_thunk", **fields)


# -------------------------------------------------------------------------------- quality
def spread_windows(tokens: np.ndarray, n: int, windows: int) -> np.ndarray:
    """``windows`` evenly spaced contiguous pieces of ``tokens`` holding ``n`` tokens together
    (plus the token after the last piece, its last target), concatenated; all of ``tokens``
    when it is too short for that."""
    if windows < 1 or windows * math.ceil(n / windows) + 1 >= len(tokens):
        return np.asarray(tokens)
    w = math.ceil(n / windows)
    starts = [round(i * (len(tokens) - w - 1) / max(1, windows - 1)) for i in range(windows)]
    pieces = [np.asarray(tokens[s:s + w]) for s in starts]
    return np.concatenate(pieces + [np.asarray(tokens[starts[-1] + w:starts[-1] + w + 1])])


def short_train(setup: Setup, tokens: int, eval_tokens: int, *, seed: int = 0,
                data_dir: str | Path | None = None, train_slice: tuple[float, float] = (0.0, 1.0),
                model: FractusCTE | None = None, threads: int = 0, windows: int = 8,
                eval_batch: int = 8, eval_chunk: int = 32) -> dict:
    """Train ``setup`` on ``tokens`` tokens of the Shakespeare training split and evaluate.

    The trainer's pieces (optimizer groups, LR warm-up + cosine to 10 %, grad clip 1.0,
    micro-steps with the carried state, PGSU block choice); warm-up is min(50, steps/10) steps.
    The text read is :func:`spread_windows`: ``windows`` evenly spaced contiguous pieces of the
    split, so every setup trained on the same number of tokens sees the same text whatever its
    batch (B streams split it; B=1 reads it in order). ``train_slice`` restricts training to a
    fraction of the split first (e.g. (0, .5) and (.5, 1) for disjoint halves); ``model`` starts
    from given weights instead of a fresh seeded model.
    Validation: ``eval_tokens`` tokens of the validation split read as ``eval_batch`` evenly
    spaced streams of ``eval_chunk``-token chunks, the same for every setup of one vocabulary.

    Returns {val_ce, val_bpb, val_ppl, val_tokens, train_ce (last step), steps, tokens, seconds};
    a given ``model`` is trained in place.
    """
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    data = Path(data_dir) if data_dir is not None else shakespeare(setup.vocab_size)
    meta = load_meta(data)
    train_tok = load_tokens(data, "train", meta)
    lo, hi = (int(f * len(train_tok)) for f in train_slice)
    steps = max(1, math.ceil(tokens / setup.tokens_per_step()))
    train_tok = spread_windows(train_tok[lo:hi], steps * setup.tokens_per_step(), windows)
    cfg = setup.config()
    if cfg.vocab_size != meta["vocab_size"]:
        raise ValueError(f"setup vocabulary {cfg.vocab_size} != data's {meta['vocab_size']}")
    torch.manual_seed(seed)
    if model is None:
        model = FractusCTE(cfg)
    model.train()
    fwd = torch.compile(model) if setup.compile else model
    opt = make_optimizer(model, setup.optimizer, setup.lr(), 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(min(50, max(1, steps // 10)), steps, 0.1))
    streams = TokenStreams(train_tok, setup.batch_size, setup.chunk_len)
    device = torch.device("cpu")
    state, ce = None, float("nan")
    for step in range(steps):
        if setup.active_blocks:
            set_active_blocks(model, setup.active_blocks, seed, step)
        batches = (streams.next() for _ in range(setup.accum))
        ce, _, state, finite = micro_steps(fwd, batches, state, setup.accum, setup.head_positions,
                                           device, False)
        if not finite:
            raise FloatingPointError(f"non-finite loss at step {step} training {setup}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    model.requires_grad_(True)
    val = evaluate_text(model, load_tokens(data, "val", meta), eval_batch, eval_chunk, eval_tokens,
                        token_byte_lengths(get_tokenizer(cfg.vocab_size)), device)
    return {**val, "train_ce": ce, "steps": steps, "tokens": steps * setup.tokens_per_step(),
            "seconds": time.perf_counter() - t0}


def _train_job(args):
    setup, tokens, eval_tokens, seed, threads = args
    return short_train(setup, tokens, eval_tokens, seed=seed, threads=threads)


def train_many(setups: list[Setup], tokens: int, eval_tokens: int, seeds: Sequence[int] = (0,),
               workers: int | None = None) -> dict[Setup, list[dict]]:
    """:func:`short_train` for each setup from each seed, in ``workers`` spawned processes of one
    thread each (quality does not depend on threads; nothing here is timed): each setup's runs
    in the order of ``seeds``."""
    setups = list(dict.fromkeys(setups))
    for v in sorted({r.vocab_size for r in setups}):
        shakespeare(v)  # prepare once, before the workers start
    jobs = [(r, tokens, eval_tokens, s, 1) for r in setups for s in seeds]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        out = [_train_job(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
            out = list(ex.map(_train_job, jobs))
    return {r: out[i * len(seeds):(i + 1) * len(seeds)] for i, r in enumerate(setups)}
