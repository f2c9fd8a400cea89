"""Held-out evaluation of a language model on a token split: :func:`evaluate_text` (cross-entropy
in nats/token, bits per byte, perplexity), reading the split as the CTE reads it
(:func:`stream_chunks`, the state carried or not) or as a model without state does
(:func:`sliding_windows`). The trainer's validation and ``python -m fractus.evaluate`` are this.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from fractus.baseline import Transformer
from fractus.data import TokenStreams
from fractus.training.steps import autocast

READS = ("auto", "carried", "chunks", "sliding")


@torch.no_grad()
def evaluate_text(model, tokens, batch_size: int, chunk_len: int, max_tokens: int | None,
             token_bytes: torch.Tensor, device: torch.device, bf16: bool = False, read: str = "auto") -> dict:
    """Held-out CE (nats/token), bits per byte and perplexity over up to ``max_tokens`` targets of
    ``tokens``, read as ``read`` says:

    - "carried": ``batch_size`` contiguous streams of ``chunk_len``-token chunks, each stream from an
      empty state that is then carried from chunk to chunk (the CTE's own reading);
    - "chunks": the same chunks, each read on its own from an empty state;
    - "sliding": windows of the transformer's ``context`` every ``context / 2`` tokens, ``batch_size``
      at a time; the first window scores all its targets, each later one the targets no earlier
      window scored, so every scored target but the first window's sees at least ``context / 2``
      tokens (the reading of a model that carries no state);
    - "auto": "carried" for a model with a state, "sliding" for one without (:class:`Transformer`).
    """
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")
    if read == "auto":
        read = "sliding" if isinstance(model, Transformer) else "carried"
    was = model.training
    model.eval()
    if read == "sliding":
        batches = sliding_windows(tokens, model.cfg.context, model.cfg.context // 2, batch_size, max_tokens)
    else:
        batches = stream_chunks(tokens, batch_size, chunk_len, max_tokens)
    ce_sum, n_tok, n_bytes, state = 0.0, 0, 0, None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device, bf16):
            _, parts, state = model(x, state if read == "carried" else None, y)
        n = int(parts["n"])
        ce_sum += parts["ce"].item() * n
        n_tok += n
        n_bytes += int(token_bytes[y[y != -100].cpu()].sum())
    model.train(was)
    ce = ce_sum / n_tok
    return {"val_ce": ce, "val_bpb": ce_sum / math.log(2) / max(1, n_bytes), "val_ppl": math.exp(ce),
            "val_tokens": n_tok}


def stream_chunks(tokens, batch_size: int, chunk_len: int, max_tokens: int | None):
    """(x, y) [batch_size, chunk_len]: the next chunk of every stream, up to ``max_tokens`` targets."""
    streams = TokenStreams(tokens, batch_size, chunk_len)
    n_chunks = streams.chunks_per_epoch
    if max_tokens:
        n_chunks = max(1, min(n_chunks, max_tokens // (batch_size * chunk_len)))
    for _ in range(n_chunks):
        yield streams.next()[:2]


def sliding_windows(tokens, context: int, stride: int, batch_size: int, max_tokens: int | None):
    """(x, y) [≤ batch_size, L] (L = context, or the split's length if shorter): sliding windows of
    ``tokens`` every ``stride`` positions and one ending at the split's end; y is -100 (not scored)
    at the targets an earlier window scored. Stops once ``max_tokens`` targets are scored."""
    n = len(tokens) - 1  # targets: tokens[1:]
    L = min(context, n)
    starts = list(range(0, n - L + 1, stride))
    if starts[-1] != n - L:
        starts.append(n - L)
    windows, scored_to, total = [], 0, 0
    for s in starts:
        windows.append((s, scored_to - s))  # (start, offset of its first target to score)
        total += s + L - scored_to
        scored_to = s + L
        if max_tokens and total >= max_tokens:
            break
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        rows = torch.from_numpy(np.stack([np.asarray(tokens[s:s + L + 1], dtype=np.int64) for s, _ in group]))
        x, y = rows[:, :-1], rows[:, 1:].clone()
        for j, (_, first) in enumerate(group):
            y[j, :first] = -100
        yield x, y
