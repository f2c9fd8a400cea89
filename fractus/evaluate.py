"""Evaluate a checkpoint: ``python -m fractus.evaluate CKPT --data DIR [--split val] [--streams 8]``.

Cross-entropy in nats/token, bits per byte and perplexity of the checkpoint's model on a split
prepared by :mod:`fractus.data`, read as the trainer's own validation reads it
(:func:`fractus.training.evaluation.evaluate_text`): a CTE as ``--streams`` contiguous streams of
``--chunk-len``-token chunks, each starting from an empty attention state that is then carried; a
Transformer++, which carries no state, in sliding windows of its context every half context,
``--streams`` windows at a time. ``--csv FILE`` appends the result as a row with its
provenance (machine, versions, git sha, date); a FILE that is not such a CSV is refused before the
evaluation, and a non-finite CE is an error that writes nothing.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from fractus.baseline import Transformer
from fractus.checkpoint import CheckpointError
from fractus.cli import device_name, positive_int, run_command
from fractus.data import load_meta, load_tokens
from fractus.ops.common import BACKENDS
from fractus.training.records import append_csv, csv_rows, provenance
from fractus.training.registry import load_model
from fractus.tokenizer import get_tokenizer, token_byte_lengths
from fractus.training.evaluation import evaluate_text

# eval: how the split was read, "carried" (a CTE's streams) or "sliding" (the Transformer++'s windows)
COLUMNS = ("checkpoint", "data", "split", "eval", "streams", "chunk_len", "tokens", "ce", "bpb", "ppl")


def evaluate_checkpoint(ckpt: str | Path, data: str | Path, split: str = "val", streams: int = 8,
                        chunk_len: int = 256, max_tokens: int | None = None, device: str = "cpu",
                        backend: str = "auto") -> dict:
    """{val_ce, val_bpb, val_ppl, val_tokens, val_read} of the checkpoint's model on ``split`` of ``data``
    (kernels: ``backend``, whatever the checkpoint was trained with), read as
    :func:`fractus.training.evaluation.evaluate_text` reads it: ``val_read`` "carried" for a CTE, "sliding" for the
    Transformer++. ValueError if the CE is not finite."""
    meta = load_meta(data)
    model = load_model(ckpt, backend=backend).to(device)
    if model.cfg.vocab_size != meta["vocab_size"]:
        raise CheckpointError(f"{ckpt} has vocab_size {model.cfg.vocab_size}, the data {data} "
                              f"{meta['vocab_size']}")
    tokens = load_tokens(data, split, meta)
    token_bytes = token_byte_lengths(get_tokenizer(meta["vocab_size"]))
    read = "sliding" if isinstance(model, Transformer) else "carried"
    r = evaluate_text(model, tokens, streams, chunk_len, max_tokens, token_bytes, torch.device(device), read=read)
    if not math.isfinite(r["val_ce"]):
        raise ValueError(f"{ckpt} gives a non-finite CE ({r['val_ce']}) on the {split} split of {data}: "
                         "its weights hold NaN or inf, or its activations overflow")
    return {**r, "val_read": read}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    ap.add_argument("--split", default="val", choices=("val", "train"))
    ap.add_argument("--streams", type=positive_int, default=8, help="contiguous streams read side by side")
    ap.add_argument("--chunk-len", type=positive_int, default=256)
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="about this many targets, whole chunks of every stream, at least one (default: all)")
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="kernels (auto: Triton on CUDA, PyTorch on CPU), whatever the checkpoint was trained with")
    ap.add_argument("--csv", help="append the result as a row of this CSV")
    a = ap.parse_args(argv)
    if a.csv and Path(a.csv).is_dir():
        ap.error(f"--csv {a.csv} is a directory; give a file")
    def body():
        if a.csv:  # a file that cannot take the row is refused before the evaluation
            csv_rows(a.csv, [*COLUMNS, *provenance(a.device)])
        r = evaluate_checkpoint(a.ckpt, a.data, a.split, a.streams, a.chunk_len, a.tokens, a.device, a.backend)
        how = (f"{a.streams} streams, state carried" if r["val_read"] == "carried" else
               f"sliding windows, {a.streams} at a time")
        print(f"{a.ckpt} on {a.split} ({r['val_tokens']:,} tokens, {how}): CE {r['val_ce']:.4f} "
              f"nats/token, {r['val_bpb']:.4f} bits/byte, perplexity {r['val_ppl']:.1f}")
        if a.csv:
            append_csv(a.csv, dict(zip(COLUMNS, (a.ckpt, a.data, a.split, r["val_read"], a.streams, a.chunk_len,
                                                 r["val_tokens"], r["val_ce"], r["val_bpb"], r["val_ppl"]))), a.device)
    run_command(body)


if __name__ == "__main__":
    main()
