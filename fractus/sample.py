"""Sample from a checkpoint: ``python -m fractus.sample CKPT [--prompt TEXT ...] [--tokens 100]``.

Each prompt is encoded with the checkpoint's tokenizer (cl100k cut to its vocabulary), prefilled
with the chunked forward, then continued tick by tick (:meth:`FractusCTE.generate`). Sample i of
a prompt uses seed ``--seed + i``, so a command prints the same text every time. A checkpoint
with a NaN or an infinity in its weights is refused.
"""
from __future__ import annotations

import argparse

import torch

from fractus.checkpoint import check_finite
from fractus.cli import (
    device_name,
    natural,
    non_negative,
    number,
    positive_int,
    run_command,
    seed_number,
)
from fractus.ops.common import BACKENDS
from fractus.model import FractusCTE
from fractus.training.registry import load_model
from fractus.tokenizer import get_tokenizer

# The prompts of TRAINING_LOG_1B.md; by default sampling (and the trainer, at the end of a run) takes the
# first, the second and the last; the generation probes take all five.
ORIGINAL_PROMPTS = ("The meaning of life is", "Hello, my name is", "In mathematics, a continuous system",
                    "Fractus thinks", "Once upon a time")
PROMPTS = ORIGINAL_PROMPTS[:2] + ORIGINAL_PROMPTS[-1:]


def sample_text(model: FractusCTE, prompt: str, max_new_tokens: int, temperature: float = 0.9,
                top_k: int | None = 50, top_p: float | None = None, repetition_penalty: float = 1.0,
                seed: int | None = 0) -> str:
    """The continuation of ``prompt`` (text in, text out; special tokens are read as text)."""
    enc = get_tokenizer(model.cfg.vocab_size)
    ids = enc.encode_ordinary(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one character")
    return enc.decode(model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    repetition_penalty=repetition_penalty, seed=seed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="a checkpoint of fractus.train, fractus.merge or FractusCTE.save")
    ap.add_argument("--prompt", action="append", help=f"repeatable (default: {', '.join(map(repr, PROMPTS))})")
    ap.add_argument("--tokens", type=positive_int, default=100, help="new tokens per sample")
    ap.add_argument("--num-samples", type=positive_int, default=1)
    ap.add_argument("--temperature", type=non_negative, default=0.9, help="0 = greedy")
    ap.add_argument("--top-k", type=natural, default=50, help="0 = off")
    ap.add_argument("--top-p", type=number(float, lambda p: 0 < p <= 1, "in (0, 1]"), default=1.0)
    ap.add_argument("--repetition-penalty", type=number(float, lambda r: r > 0, "> 0"), default=1.0)
    ap.add_argument("--seed", type=seed_number, default=0)
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="kernels (auto: Triton on CUDA, PyTorch on CPU), whatever the checkpoint was trained with")
    a = ap.parse_args(argv)

    def body():
        model = load_model(a.ckpt, backend=a.backend)
        check_finite(model.state_dict(), a.ckpt)
        model.to(a.device)
        for prompt in a.prompt or PROMPTS:
            for i in range(a.num_samples):
                text = sample_text(model, prompt, a.tokens, a.temperature, a.top_k or None, a.top_p,
                                   a.repetition_penalty, a.seed + i)
                print(f"--- {prompt!r} →{text!r}", flush=True)
    run_command(body)


if __name__ == "__main__":
    main()
