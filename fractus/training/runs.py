"""A run directory (the trainer's ``--out``): ``ckpt.pt``, ``metrics.csv`` and ``.lock``.

``metrics.csv`` holds one row per optimizer step, appended and fsynced as the step ends; the last
row also holds the final validation. :func:`run_lock` keeps a second run out of the directory, and
:func:`remove_leftover_temps` clears what a process killed while writing left there. The trainer,
:mod:`fractus.training.records` (a finished run as a results CSV) and the GPU suite read it with these.
"""
from __future__ import annotations

import contextlib
import csv
import fcntl
import math
import os
from pathlib import Path

from fractus.atomic import atomic_open, leftover_temps

RUN_FILES = ("ckpt.pt", "metrics.csv", ".lock")  # what a run directory holds
METRIC_FIELDS = ("step", "tokens", "lr", "train_ce", "train_lb", "grad_norm", "tok_s", "skipped",
                 "val_ce", "val_bpb", "val_ppl", "elapsed_s")


def planned_steps(args: dict, world: int) -> int:
    """Optimizer steps of a run with the flags ``args`` (as ``vars`` of the parsed CLI, which a
    checkpoint records) on ``world`` processes."""
    return max(1, math.ceil(args["tokens"] / (world * args["batch_size"] * args["chunk_len"] * args["accum"])))


def append_metrics(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in METRIC_FIELDS})
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: Path) -> list[dict]:
    """metrics.csv's complete rows (a row cut by a kill is dropped); ValueError naming the file
    unless it is a CSV with a ``step`` column of integers and no row longer than its header."""
    if not path.exists():
        return []
    rows = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is not None and "step" not in reader.fieldnames:
                raise ValueError("its header has no step column")
            for r in reader:
                if None in r:
                    raise ValueError(f"line {reader.line_num} has more values than the header has columns")
                if None in r.values():  # cut short
                    continue
                if not (r["step"].isascii() and r["step"].isdigit()):
                    raise ValueError(f"line {reader.line_num}: step {r['step']!r} is not a step number")
                rows.append(r)
    except (UnicodeDecodeError, csv.Error, ValueError) as e:
        raise ValueError(f"{path} is not a metrics file of this trainer: {e}") from None
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    """Replace metrics.csv with ``rows``, atomically."""
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in METRIC_FIELDS} for r in rows)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be produced again); the
    file keeps its own columns (the trainer's :data:`METRIC_FIELDS`, the vision trainer's)."""
    rows = read_metrics(path)
    if rows:
        with atomic_open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(r for r in rows if int(r["step"]) <= last_step)


def record_final(path: Path, step: int, final: dict) -> None:
    """Put the final validation into step ``step``'s row (one row per step; a rerun replaces it)."""
    rows = read_metrics(path)
    if not rows or int(rows[-1]["step"]) != step:
        rows.append({"step": step})
    rows[-1].update({k: final[k] for k in ("val_ce", "val_bpb", "val_ppl")})
    write_metrics(path, rows)


def check_metrics_record(path: Path, step: int, every: int = 1) -> None:
    """ValueError unless metrics.csv holds a row for each ``every``-th step up to ``step`` (the
    checkpoint's), in order (the trainer logs every step, the vision trainer every epoch's last):
    resuming from an incomplete record would leave the run's record silently incomplete."""
    steps = [int(r["step"]) for r in read_metrics(path) if int(r["step"]) <= step]
    expected = list(range(every, step + 1, every))
    if steps == expected:
        return
    missing = sorted(set(expected) - set(steps))
    if not path.exists():
        what = "does not exist"
    elif missing:
        what = f"lacks the rows of {len(missing)} of them (the first: step {missing[0]})"
    else:
        what = "holds them out of order or more than once"
    raise ValueError(f"refusing to resume: the checkpoint is at step {step}, but {path}, the record of steps "
                     f"1–{step}, {what}; restore it, or train again in another --out")


class RunInUse(RuntimeError):
    """The run directory is locked by another process's run."""


@contextlib.contextmanager
def run_lock(out: Path, option: str = "--out"):
    """Hold an exclusive ``flock`` on ``out/.lock`` (``out`` created if absent) until the block
    ends: two runs writing one directory would interleave metrics.csv and overwrite each other's
    checkpoints. The OS drops the lock when its process dies, so a killed run never blocks the
    ``--resume`` that continues it. ``option``: the command-line option that named ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(f"{out} is in use by another run (the process holding the lock {out / '.lock'}): wait "
                           f"for that run to end, or choose another {option}") from None
        yield


def remove_leftover_temps(paths) -> None:
    """Remove the temporary files a process killed while writing one of ``paths`` left beside it
    (:func:`fractus.atomic.atomic_open`'s); only safe while holding the run's lock."""
    temps = [t for p in paths for t in leftover_temps(p)]
    for t in temps:
        t.unlink(missing_ok=True)
    if temps:
        print(f"removed {len(temps)} temporary file(s) of an interrupted write: {', '.join(t.name for t in temps)}")


def clear_unstarted(out: Path) -> None:
    """A run stopped before its first checkpoint (killed, a full disk) holds nothing to resume: its
    run files go, so that it starts again rather than being refused for ever. Only safe while no
    other process trains in ``out``."""
    if out.is_dir() and not (out / "ckpt.pt").exists():
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        remove_leftover_temps([out / name for name in RUN_FILES])
