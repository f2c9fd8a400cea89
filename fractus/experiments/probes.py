"""Probes of a trained model: repetition in generated text, decode vs chunked forward, and the
merge probe (two runs from one initialisation on disjoint halves of the data, and their mean).
"""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import torch

from fractus.bench.setup import Setup
from fractus.experiments.optimizations import short_train, shakespeare
from fractus.checkpoint import weights_fingerprint
from fractus.data import load_meta, load_tokens
from fractus.merge import distance_to_mean, merge
from fractus.model import FractusCTE
from fractus.sample import ORIGINAL_PROMPTS as PROMPTS
from fractus.tokenizer import get_tokenizer, token_byte_lengths
from fractus.training.evaluation import evaluate_text

# Decoding strategies compared by the repetition probe: name → model.generate keyword arguments.
STRATEGIES = {
    "greedy": dict(temperature=0.0),
    "sampling (T=0.9, top-k 50)": dict(temperature=0.9, top_k=50),
    "top-p 0.9 (T=0.9)": dict(temperature=0.9, top_p=0.9),
    "repetition penalty 1.3 (T=0.9, top-k 50)": dict(temperature=0.9, top_k=50, repetition_penalty=1.3),
}


# ------------------------------------------------------------------------------ repetition
def distinct_n(tokens: list, n: int) -> float:
    """Distinct n-grams / n-grams (1.0: nothing repeats; 0 when the sequence is shorter than n)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def longest_repeat_run(tokens: list) -> tuple[int, int]:
    """(length, period) of the longest contiguous stretch made of ≥ 2 back-to-back copies of
    one n-gram (a stretch of period p: tokens[i] == tokens[i − p] throughout, length ≥ 2p).
    (0, 0) when nothing repeats back to back. Ties keep the shortest period."""
    best = (0, 0)
    n = len(tokens)
    for p in range(1, n // 2 + 1):
        run = 0
        for i in range(p, n):
            run = run + 1 if tokens[i] == tokens[i - p] else 0
            if run >= p and run + p > best[0]:
                best = (run + p, p)
    return best


def top_token_share(tokens: list) -> float:
    """Share of the sequence taken by its most frequent token."""
    return Counter(tokens).most_common(1)[0][1] / len(tokens) if tokens else 0.0


def repetition_metrics(tokens: list) -> dict:
    run, period = longest_repeat_run(tokens)
    return {"distinct_1": distinct_n(tokens, 1), "distinct_2": distinct_n(tokens, 2),
            "longest_repeat_run": run, "repeat_period": period, "top_token_share": top_token_share(tokens)}


def generation_table(model: FractusCTE, enc, prompts=PROMPTS, strategies=STRATEGIES,
                     max_new_tokens: int = 40, seed: int = 0) -> list[dict]:
    """Generate (tick by tick) for every prompt and strategy; one row each with the new token
    ids, their text and their repetition metrics."""
    rows = []
    for name, kw in strategies.items():
        for i, p in enumerate(prompts):
            ids = model.generate(enc.encode_ordinary(p), max_new_tokens, seed=seed + i, **kw)
            rows.append({"strategy": name, "prompt": p, "text": enc.decode(ids), "new_tokens": len(ids),
                         "ids": ids, **repetition_metrics(ids)})
    return rows


# ------------------------------------------------------------------------------ decode vs forward
@torch.no_grad()
def decode_vs_forward(model: FractusCTE, ids: list[int]) -> dict:
    """Max relative error between the logits of the chunked forward over ``ids`` and those of
    ``len(ids)`` single-token :meth:`FractusCTE.step` calls, and the argmax agreement."""
    was = model.training
    model.eval()
    x = torch.tensor([ids], dtype=torch.long, device=model.embed.weight.device)
    full, _, _ = model(x)
    state, steps = None, []
    for t in range(x.shape[1]):
        lg, state = model.step(x[:, t], state)
        steps.append(lg)
    step = torch.stack(steps, 1)
    model.train(was)
    err = ((step - full).abs().amax() / full.abs().amax().clamp_min(1e-30)).item()
    return {"positions": x.shape[1], "max_rel_err": err,
            "argmax_agreement": (step.argmax(-1) == full.argmax(-1)).float().mean().item()}


# ------------------------------------------------------------------------------ merge probe
def mean_merge(states: list[dict]) -> dict:
    """Parameter mean of state dicts, computed here independently of :mod:`fractus.merge` to
    cross-check it (non-float buffers are taken from the first)."""
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            out[k] = torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype)
        else:
            out[k] = v.clone()
    return out


def merge_checkpoints(models: list[FractusCTE], ancestor: str) -> FractusCTE:
    """Mean of the models, all started from the weights with fingerprint ``ancestor``, through
    :func:`fractus.merge.merge` (checkpoints written to a temporary folder), loaded back as a model."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, m in enumerate(models):
            paths.append(Path(tmp) / f"part{i}.pt")
            m.save(paths[-1], ancestor=ancestor)
        merge(paths, Path(tmp) / "merged.pt")
        return FractusCTE.load(Path(tmp) / "merged.pt")


def reference_metrics(tokens, n_windows: int = 20, length: int = 40) -> list[dict]:
    """Repetition metrics of ``n_windows`` evenly spaced ``length``-token windows of real text
    (e.g. the validation split): what natural text scores."""
    step = max(1, (len(tokens) - length) // n_windows)
    return [repetition_metrics([int(t) for t in tokens[i * step:i * step + length]]) for i in range(n_windows)]


def merge_probe(setup: Setup, tokens_per_half: int, eval_tokens: int, seed: int = 0) -> dict:
    """Two runs from one seeded initialisation, each on its own half of the training split
    (``tokens_per_half`` tokens each), and their mean-merge through :func:`fractus.merge.merge`.

    Returns {"rows": [{model, val_ce, val_bpb, relative_distance_to_merge, tokens_seen}] for
    the initialisation, half A, half B and the merge; "merge_vs_mean": the largest absolute
    difference between fractus.merge's result and :func:`mean_merge` of the two;
    "unigram_entropy": the validation split's, nats/token}.
    """
    data = shakespeare(setup.vocab_size)
    meta = load_meta(data)
    cfg = setup.config()
    torch.manual_seed(seed)
    init = FractusCTE(cfg)
    runs = {}
    for name, sl in (("half A", (0.0, 0.5)), ("half B", (0.5, 1.0))):
        m = FractusCTE(cfg)
        m.load_state_dict(init.state_dict())
        short_train(setup, tokens_per_half, eval_tokens, seed=seed, train_slice=sl, model=m)
        runs[name] = m
    merged = merge_checkpoints(list(runs.values()), weights_fingerprint(init.state_dict()))
    msd = merged.state_dict()
    ref = mean_merge([m.state_dict() for m in runs.values()])
    gap = max(float((msd[k].double() - v.double()).abs().max()) for k, v in ref.items() if v.is_floating_point())
    tb = token_byte_lengths(get_tokenizer(cfg.vocab_size))
    val = load_tokens(data, "val", meta)

    rows = []
    for name, m, seen in (("initialisation", init, 0), ("half A", runs["half A"], tokens_per_half),
                          ("half B", runs["half B"], tokens_per_half),
                          ("mean-merge of A and B", merged, 2 * tokens_per_half)):
        r = evaluate_text(m, val, 8, 32, eval_tokens, tb, torch.device("cpu"))
        rows.append({"model": name, "val_ce": r["val_ce"], "val_bpb": r["val_bpb"],
                     "relative_distance_to_merge": distance_to_mean(m.state_dict(), msd), "tokens_seen": seen})
    return {"rows": rows, "merge_vs_mean": gap, "unigram_entropy": meta["val"]["unigram_entropy_nats"]}
