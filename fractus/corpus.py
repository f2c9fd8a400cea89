"""Corpora larger than memory: documents streamed from files, tokenized by a pool of processes,
written to shards of a fixed token count.

Inputs (:func:`documents`): a UTF-8 text file (one document), JSON Lines (``.jsonl``, one JSON
object a line, its text in a field), Parquet (``.parquet``, a text column, read by pyarrow a
record batch at a time), each optionally compressed (``.gz``, ``.zst``), or a folder of such files
(sorted, recursively, hidden ones skipped). Every document comes with where it came from
(``file:line`` or ``file:row``), so that a bad one is named.

Tokenizing (:func:`encoded_batches`): batches of about :data:`BATCH_BYTES` of text go to
``workers`` processes (each with its own tokenizer, one thread), and come back in input order:
the output does not depend on the number of workers. A text longer than :data:`PIECE_CHARS` is
encoded in pieces cut after a line break that a non-space character follows, where the
tokenizer's pre-tokenization splits anyway, so its tokens are those of the whole text.

Writing (:class:`ShardWriter`): each split's tokens go to ``<split>-NNNNN.bin`` files of exactly
``shard_tokens`` tokens (the last one shorter), each written whole (atomically), and described
in a manifest entry: file, tokens, CRC-32 of its bytes, largest id. The loader then checks sizes
from the manifest and, when asked, the checksums a chunk at a time: never an array the size of
the corpus.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import multiprocessing as mp
import sys
import types
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fractus.atomic import atomic_open

BATCH_BYTES = 1 << 20  # text sent to a worker at a time
PIECE_CHARS = 1 << 22  # a longer text is encoded in pieces
RECORD_FORMATS = (".jsonl", ".parquet")
COMPRESSIONS = (".gz", ".zst")
# endings of files that hold data in a format prepare does not read: refused rather than read as text
UNREAD = (".json", ".csv", ".tsv", ".arrow", ".feather", ".bz2", ".xz", ".lz4", ".zip", ".tar", ".7z", ".bin", ".npy")


@dataclass(frozen=True)
class Source:
    """One input file: its path, its format ("text", "jsonl", "parquet"), compression (None, "gz",
    "zst") and the name documents give it (its path below the input folder)."""
    path: Path
    format: str
    compression: str | None = None
    name: str = ""


def source(path: Path, name: str = "") -> Source:
    """What :func:`documents` makes of ``path``, from its endings: ValueError for an ending of a
    format it does not read, or a compression of Parquet (compressed inside the file already)."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes[-1][1:] if suffixes and suffixes[-1] in COMPRESSIONS else None
    base = suffixes[-2 if compression else -1] if len(suffixes) > (1 if compression else 0) else ""
    if base == ".parquet" and compression:
        raise ValueError(f"{path}: a Parquet file is compressed inside; give it without .{compression}")
    if base in RECORD_FORMATS:
        return Source(path, base[1:], compression, name or path.name)
    if base in UNREAD or (not compression and suffixes and suffixes[-1] in UNREAD):
        raise ValueError(f"{path}: files ending in {base or suffixes[-1]} are not read; give UTF-8 text, .jsonl or "
                         f".parquet, optionally {' or '.join(COMPRESSIONS)}")
    return Source(path, "text", compression, name or path.name)


def input_files(path: str | Path) -> list[Source]:
    """The sources of a file, or of every file below a folder (sorted; hidden files and folders
    skipped)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    elif path.is_file():
        files = [path]
    elif path.exists():
        raise ValueError(f"{path} is neither a regular file nor a directory (a device, a pipe, a socket): give "
                         "a text, .jsonl or .parquet file or a folder of them")
    else:
        raise FileNotFoundError(f"no such file or directory: {path}")
    if not files:
        raise ValueError(f"{path} holds no files")
    return [source(f, str(f.relative_to(path)) if path.is_dir() else f.name) for f in files]


def _binary(src: Source):
    if src.compression == "gz":
        return gzip.open(src.path, "rb")
    if src.compression == "zst":
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(open(src.path, "rb"), closefd=True)
    return open(src.path, "rb")


def _text(src: Source) -> str:
    with _binary(src) as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{src.path} is not UTF-8 text: line {line}, byte {e.start}: {e.reason}") from None


def _whole(src: Source) -> Iterator[tuple[str, str]]:
    yield src.name, _text(src)


def _jsonl(src: Source, field_name: str) -> Iterator[tuple[str, str]]:
    with _binary(src) as f:
        for i, raw in enumerate(io.BufferedReader(f) if src.compression == "zst" else f, 1):
            where = f"{src.path}:{i}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
            text = obj.get(field_name) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{where}: no text field {field_name!r} (give --text-field)")
            yield where, text


def _parquet(src: Source, column: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(src.path)
    except pa.ArrowException as e:
        raise ValueError(f"{src.path}: not a Parquet file ({e})") from None
    if column not in f.schema_arrow.names:
        raise ValueError(f"{src.path}: no column {column!r} (columns: {f.schema_arrow.names}; give --text-field)")
    row = 0
    for batch in f.iter_batches(columns=[column], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(f"{src.path}:row {row}: column {column!r} holds {type(text).__name__}, not text")
            yield f"{src.path}:row {row}", text


def documents(sources: list[Source], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) of every document of ``sources`` in order, blank ones skipped; read a file, a
    line or a record batch at a time (a text file is one document, read whole, named by its
    source's name; a record by its file and line or row). A damaged compressed file is a
    ValueError naming it."""
    for src in sources:
        if src.format == "text":
            docs = _whole(src)
        elif src.format == "jsonl":
            docs = _jsonl(src, text_field)
        else:
            docs = _parquet(src, text_field)
        try:
            for where, text in docs:
                if text.strip():
                    yield where, text
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ValueError(f"{src.path}: not a whole {src.compression} file ({e})") from None
        except Exception as e:
            if type(e).__name__ != "ZstdError":
                raise
            raise ValueError(f"{src.path}: not a whole zst file ({e})") from None


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just after a line break
    followed by a non-space character (where pre-tokenization splits: the pieces' tokens are the
    whole text's); a text without such a break stays whole."""
    out, start = [], 0
    while len(text) - start > size:
        cut = start + size
        while cut < len(text) and not (text[cut - 1] == "\n" and not text[cut].isspace()):
            cut += 1
        if cut >= len(text):
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


_ENCODER = None


def _start_worker(vocab_size: int) -> None:
    global _ENCODER
    from fractus.tokenizer import get_tokenizer
    _ENCODER = get_tokenizer(vocab_size)


def _encode(texts: list[str]) -> tuple[np.ndarray, list[int], list[int]]:
    """(ids of every text, each followed by EOT, as one array of the token files' type — uint16 for
    a vocabulary of up to 65,536, a quarter of int64's bytes to send back; each text's token count;
    each text's UTF-8 bytes)."""
    eot = _ENCODER.eot_token
    dtype = np.uint16 if _ENCODER.n_vocab <= 65536 else np.uint32
    ids, lengths = [], []
    for text in texts:
        n = 0
        for piece in pieces(text):
            p = _ENCODER.encode_ordinary(piece)
            ids.append(np.asarray(p, dtype=dtype))
            n += len(p)
        ids.append(np.asarray([eot], dtype=dtype))
        lengths.append(n + 1)
    n_bytes = [len(t.encode("utf-8")) for t in texts]
    return np.concatenate(ids) if ids else np.zeros(0, dtype), lengths, n_bytes


def _batches(docs, batch_bytes: int) -> Iterator[tuple[list[str], list]]:
    texts, tags, size = [], [], 0
    for name, text, tag in docs:
        texts.append(text)
        tags.append((name, tag))
        size += len(text)
        if size >= batch_bytes:
            yield texts, tags
            texts, tags, size = [], [], 0
    if texts:
        yield texts, tags


@contextlib.contextmanager
def _worker_pool(workers: int, vocab_size: int):
    """A pool of ``workers`` spawned processes that import this module and the tokenizer only. A
    spawned process imports the parent's main module first (for ``python -m fractus.data``:
    ``fractus.data``, and torch with it, ~300 MB a worker); the workers are started while
    ``__main__`` is a bare module, which they then have nothing to import for (the work they run is
    this module's)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        pool = mp.get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(vocab_size,))
    finally:
        sys.modules["__main__"] = main
    with pool:
        yield pool


def encoded_batches(docs, vocab_size: int, workers: int = 1, batch_bytes: int = BATCH_BYTES) -> Iterator[tuple]:
    """For consecutive batches of ``docs`` ((name, text, tag) each), in order: (ids, each
    document's token count, each one's UTF-8 bytes, each one's (name, tag)) — :func:`_encode` run
    by a pool of ``workers`` processes (at most ``2 · workers`` batches in flight, so memory stays
    bounded whatever the corpus), or in this process for one worker or a corpus of one batch."""
    batches = _batches(docs, batch_bytes)
    first = next(batches, None)
    second = next(batches, None) if first is not None else None
    if workers <= 1 or second is None:
        _start_worker(vocab_size)
        for batch in itertools.chain([first, second], batches):
            if batch is not None:
                yield (*_encode(batch[0]), batch[1])
        return
    with _worker_pool(workers, vocab_size) as pool:
        pending = []
        for texts, tags in itertools.chain([first, second], batches):
            pending.append((pool.apply_async(_encode, (texts,)), tags))
            if len(pending) >= 2 * workers:
                job, tags = pending.pop(0)
                yield (*job.get(), tags)
        for job, tags in pending:
            yield (*job.get(), tags)


def crc32_of(path: Path, chunk: int = 1 << 24) -> int:
    """CRC-32 of a file's bytes, read ``chunk`` bytes at a time."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


@dataclass
class ShardWriter:
    """Tokens appended in order to ``folder/<split>-NNNNN.bin`` shards of ``shard_tokens`` tokens of
    ``dtype``; each shard is written whole (atomically) when full or at :meth:`close`, and its
    manifest entry (file, tokens, crc32, max_id) appended to :attr:`shards`."""
    folder: Path
    split: str
    shard_tokens: int
    dtype: type
    shards: list = field(default_factory=list)
    tokens: int = 0
    _file: object = None
    _ctx: object = None
    _in_shard: int = 0
    _crc: int = 0
    _max: int = -1

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        while len(ids):
            if self._file is None:
                self._open()
            take = ids[:self.shard_tokens - self._in_shard].astype(self.dtype)
            data = take.tobytes()
            try:
                self._file.write(data)
            except BaseException as e:  # the atomic write removes its file and names it in an OSError
                ctx, self._file, self._ctx = self._ctx, None, None
                if not ctx.__exit__(type(e), e, e.__traceback__):
                    raise
            self._crc = zlib.crc32(data, self._crc)
            self._max = max(self._max, int(take.max()))
            self._in_shard += len(take)
            self.tokens += len(take)
            ids = ids[len(take):]
            if self._in_shard == self.shard_tokens:
                self._finish()

    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}.bin"

    def _open(self) -> None:
        self._ctx = atomic_open(self.folder / self._name(), "wb")
        self._file = self._ctx.__enter__()
        self._in_shard, self._crc, self._max = 0, 0, -1

    def _finish(self) -> None:
        self._ctx.__exit__(None, None, None)
        self.shards.append({"file": self._name(), "tokens": self._in_shard, "crc32": self._crc, "max_id": self._max})
        self._file = self._ctx = None

    def close(self) -> list[dict]:
        """Write the last, partial shard; the manifest entries."""
        if self._file is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        """Drop the shard being written (its temporary file), as after an error."""
        if self._ctx is not None:
            try:
                self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)
            except RuntimeError:
                pass
            self._file = self._ctx = None
