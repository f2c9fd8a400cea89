"""What preparing a corpus costs: throughput and peak memory of ``python -m fractus.data prepare``
against tiktoken's own batch encoder on the same text and cores (the ceiling).

The corpus is generated here, never downloaded (:func:`write_corpus`): JSON Lines of documents cut
from the 38 built-in plays — each document a run of 20 to 400 consecutive lines of one play, the
play, start and length drawn from a seeded generator — until the file holds ``gigabytes`` of text.
Each measurement runs in a fresh process (its peak resident memory is its own, read from
``/proc``'s ``VmHWM``: the process's and, for the pool, its largest worker's, sampled while it
runs), one after the other:

- ``tiktoken``: ``encode_ordinary_batch`` over the documents' texts, 1 MB of text a call, on
  ``threads`` threads (the Rust encoder's own parallelism), reading the same file;
- ``prepare``: the whole command (read, tokenize with ``workers`` processes, write shards).

``python -m fractus.bench.prepare --gigabytes 2 --out results/prepare_cpu.csv``; rows: method,
workers (threads for tiktoken), input bytes, tokens, seconds, MB/s, tokens/s, peak RSS (MB), and
the ratio to tiktoken's at the same core count, with provenance.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fractus.cli import non_negative, positive_int, run_command


def write_corpus(path: Path, gigabytes: float, seed: int = 0) -> Path:
    """JSON Lines (field ``text``) of play excerpts until ``gigabytes`` of text (see the module)."""
    from fractus.data import shakespeare_plays
    plays = [text.splitlines() for _, text in shakespeare_plays()]
    rng, size, target = random.Random(seed), 0, int(gigabytes * 1e9)
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            lines = plays[rng.randrange(len(plays))]
            start = rng.randrange(len(lines))
            text = "\n".join(lines[start:start + rng.randint(20, 400)]) + "\n"
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode("utf-8"))
    return path


def _tiktoken(path: str, vocab: int, threads: int) -> dict:
    from fractus.tokenizer import get_tokenizer
    enc = get_tokenizer(vocab)
    tokens = size = 0
    t0 = time.perf_counter()
    batch, batch_size = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            batch_size += len(text)
            size += len(text.encode("utf-8"))
            if batch_size >= 1 << 20:
                tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=threads)))
                batch, batch_size = [], 0
    tokens += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=threads))) if batch else 0
    return {"bytes": size, "tokens": tokens, "seconds": time.perf_counter() - t0}


def _prepare(path: str, vocab: int, workers: int) -> dict:
    from fractus.data import prepare
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        meta = prepare(path, out, vocab, workers=workers, force=True)
        seconds = time.perf_counter() - t0
    return {"bytes": meta["train"]["bytes"] + meta["val"]["bytes"],
            "tokens": meta["train"]["tokens"] + meta["val"]["tokens"], "seconds": seconds}


def peak_mb(pid: int | str = "self") -> float:
    """A process's peak resident memory (MB) since it started its program: ``VmHWM``. Not
    ``getrusage``'s ``ru_maxrss``: Linux counts in it the memory the process had before its
    ``exec`` — a copy of its parent's, at the fork — so a small worker of a large parent reads large."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class WorkerPeaks:
    """Samples this process's live children's ``VmHWM`` every ``every`` seconds, keeping each one's
    last reading (a worker's peak until it exits) — the workers' own peaks, as :func:`peak_mb`."""

    def __init__(self, every: float = 0.2):
        import threading
        self.every, self.peaks, self._stop = every, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import multiprocessing as mp
        while not self._stop.is_set():
            for p in mp.active_children():
                try:
                    self.peaks[p.pid] = peak_mb(p.pid)
                except (OSError, ValueError):  # exited between the listing and the reading
                    pass
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure_one(method: str, path: str, vocab: int, n: int) -> dict:
    """One measurement in this process: the counts, the seconds and the peak resident memory (MB)
    of this process and of its largest worker (:func:`peak_mb`); ``peak_rss_mb`` bounds the total
    from above (this process plus ``n`` workers at the largest one's peak; tiktoken's threads are
    in this process)."""
    with WorkerPeaks() as workers:
        r = (_tiktoken if method == "tiktoken" else _prepare)(path, vocab, n)
    own = peak_mb()
    worker = max(workers.peaks.values(), default=0.0)
    return {**r, "peak_rss_main_mb": own, "peak_rss_worker_mb": worker,
            "peak_rss_mb": own + (n * worker if worker else 0.0)}


def in_fresh_process(method: str, path: Path, vocab: int, n: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "fractus.bench.prepare", "--one", method, str(n), str(path),
                          "--vocab", str(vocab)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(path: Path, vocab: int = 8192, cores=(1, 2)) -> list[dict]:
    """A row per (method, cores): tiktoken at ``n`` threads, then prepare with ``n`` workers."""
    rows = []
    for n in cores:
        base = None
        for method in ("tiktoken", "prepare"):
            r = in_fresh_process(method, path, vocab, n)
            row = {"method": method, "cores": n, **r, "mb_s": r["bytes"] / r["seconds"] / 1e6,
                   "tokens_s": r["tokens"] / r["seconds"]}
            base = base or row
            rows.append({**row, "vs_tiktoken": row["tokens_s"] / base["tokens_s"]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.bench.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gigabytes", type=non_negative, default=2.0, help="text in the generated corpus")
    ap.add_argument("--vocab", type=positive_int, default=8192)
    ap.add_argument("--cores", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--corpus", default=None, help="where the generated corpus goes (default: a temporary file)")
    ap.add_argument("--out", default="results/prepare_cpu.csv")
    ap.add_argument("--one", nargs=3, metavar=("METHOD", "N", "PATH"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure_one(a.one[0], a.one[2], a.vocab, int(a.one[1]))))
        return

    def body():
        import pandas as pd

        from fractus.training.records import write_csv
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(a.corpus or Path(tmp) / "corpus.jsonl")
            if not path.exists():
                write_corpus(path, a.gigabytes)
            rows = measure(path, a.vocab, a.cores)
        write_csv(a.out, rows)
        print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    run_command(body)


if __name__ == "__main__":
    main()
