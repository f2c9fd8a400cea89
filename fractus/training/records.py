"""Where and with what a measurement was made, and the results CSVs that carry it: every row
of ``results/*.csv`` carries the provenance columns (machine, device, torch, triton, git_sha, date).

``python -m fractus.training.records RUN --out CSV [--label TEXT] [--force]`` writes a finished training
run's ``metrics.csv`` as such a CSV: each row with the run's label, the fingerprint of its
checkpoint's weights and the provenance of the training process that logged it.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import fcntl
import functools
import json
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from fractus.atomic import atomic_open
from fractus.checkpoint import load_checkpoint, weights_fingerprint
from fractus.cli import run_command
from fractus.training.resume import check_training_state
from fractus.training.runs import RUN_FILES, planned_steps, read_metrics

REPO = Path(__file__).resolve().parents[2]  # the checkout: results/, data/


def _code_cells(notebook_json: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(notebook_json)["cells"] if c["cell_type"] == "code"]


def git_sha(root: Path = REPO) -> str:
    """HEAD's short sha, with "-dirty" when a tracked file differs from it, except a run's own
    outputs: files under ``results/``, and notebooks whose code cells are HEAD's (a notebook run
    in place, as ``make notebooks`` does one after another, changes only its outputs)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout

    def outputs_only(path: str) -> bool:
        if not path.endswith(".ipynb"):
            return False
        try:
            return _code_cells((top / path).read_text()) == _code_cells(git("show", f"HEAD:{path}"))
        except (OSError, ValueError, KeyError):
            return False
    try:
        sha = git("rev-parse", "--short=12", "HEAD").strip()
        if not sha:
            return "unknown"
        top = Path(git("rev-parse", "--show-toplevel").strip())
        changed = git("diff", "--name-only", "HEAD", "--", ".", ":(exclude)results").splitlines()
        return sha + ("-dirty" if any(not outputs_only(p) for p in changed) else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache
def cuda_name(index: int | None) -> str:
    """The GPU's name, read once: rows written after a kernel lost CUDA's context still get it."""
    return torch.cuda.get_device_name(index)


def provenance(device: torch.device | str = "cpu") -> dict:
    """Where and with what a measurement was made: one dict per row of every results CSV."""
    device = torch.device(device)
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "absent"
    if device.type == "cuda":
        dev = cuda_name(device.index)
    else:
        dev = f"cpu: {cpu_name()} ({torch.get_num_threads()} threads)"
    return {
        "machine": f"{socket.gethostname()} {platform.machine()} {os.cpu_count()} cores",
        "device": dev,
        "torch": str(torch.__version__),  # not TorchVersion: checkpoints hold plain values
        "triton": triton_v,
        "git_sha": git_sha(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_csv(path: str | Path, rows: Iterable[dict], device: torch.device | str = "cpu") -> Path:
    """Write ``rows`` with provenance columns appended to each; returns the path."""
    rows = list(rows)
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    prov = provenance(device)
    return _write_rows(path, [{**r, **prov} for r in rows])


def append_csv(path: str | Path, row: dict | list[dict], device: torch.device | str = "cpu",
               replace: tuple[str, ...] = ()) -> Path:
    """Add ``row`` (or each of a list of rows, all at once) with its provenance to the CSV at ``path``
    (created if absent), keeping the rows already there as they are — but for those whose values of
    the columns ``replace`` are those of a row added (a run's rows written again replace its
    earlier ones); refused as :func:`csv_rows` says. A row that names its own provenance (made in
    another process: a worker's threads) keeps it. Processes appending to one file at once each
    add their rows: the read and the replace happen under a lock on its folder."""
    prov = provenance(device)
    rows = [{**{k: v for k, v in r.items() if k not in prov}, **{k: r.get(k, v) for k, v in prov.items()}}
            for r in (row if isinstance(row, list) else [row])]
    path = Path(path)
    csv_rows(path, list(rows[0]))  # refused now, not after waiting for the lock; creates the folder
    new = {tuple(str(r[k]) for k in replace) for r in rows}
    with folder_lock(path.parent):
        kept = [r for r in csv_rows(path, list(rows[0])) if not replace or tuple(r[k] for k in replace) not in new]
        return _write_rows(path, [*kept, *rows])


@contextlib.contextmanager
def folder_lock(folder: Path):
    """An exclusive ``flock`` on ``folder`` until the block ends (waits for the holder; the OS
    drops it if the holder dies). No lock file is left behind."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def csv_rows(path: str | Path, columns: list[str]) -> list[dict]:
    """The rows of the CSV at ``path`` ([] if absent or empty), once it is known that a row of
    ``columns`` can be added: ValueError naming the file unless it is a CSV of exactly these
    columns, OSError unless its folder can be written."""
    path = Path(path)
    lines = []
    if path.exists():
        try:
            with open(path, newline="") as f:
                lines = [r for r in csv.reader(f) if r]
        except (UnicodeDecodeError, csv.Error) as e:
            raise ValueError(f"{path} is not a CSV file ({e}): refusing to add a row to it") from None
        if lines and (lines[0] != columns or any(len(r) != len(columns) for r in lines)):
            raise ValueError(f"{path} is not a CSV of the columns {', '.join(columns)}: refusing to add a "
                             "row to it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise OSError(f"cannot write {path}: its folder cannot be created or written ({e.strerror})") from None
    return [dict(zip(columns, r)) for r in lines[1:]]


def _write_rows(path: str | Path, rows: list[dict]) -> Path:
    """``rows`` to ``path`` atomically, columns in order of first appearance."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def run_rows(run: str | Path, label: str | None = None) -> list[dict]:
    """A finished training run's ``metrics.csv`` rows (``run``: the trainer's ``--out``), each with
    ``run`` (``label``, by default the folder), ``weights`` (the fingerprint of the checkpoint's
    weights) and the provenance of the training process that logged its step (the checkpoint's
    ``sessions``; the last row's final validation: the last process's, which may only have validated
    a finished run again). ValueError unless the run reached its planned steps, metrics.csv holds
    one row for each step and ends with the final validation, and the checkpoint records the process
    of every step; CheckpointError for a checkpoint without a training state."""
    run = Path(run)
    ckpt = load_checkpoint(run / "ckpt.pt")
    check_training_state(ckpt, run / "ckpt.pt")
    rows = read_metrics(run / "metrics.csv")
    total = planned_steps(ckpt["args"], ckpt.get("world", 1))
    if ckpt["step"] != total or not rows or int(rows[-1]["step"]) != total or not rows[-1]["val_ce"]:
        raise ValueError(f"{run} is not a finished run: its checkpoint is at step {ckpt['step']} of {total}, and "
                         "its metrics.csv must end there with the final validation")
    if [int(r["step"]) for r in rows] != list(range(1, total + 1)):
        raise ValueError(f"{run / 'metrics.csv'} does not hold one row for each of steps 1–{total}, in order "
                         f"({len(rows)} rows from step {rows[0]['step']}): the run's record is incomplete")
    sessions = sorted(ckpt.get("sessions", []), key=lambda s: s["from_step"])
    weights = weights_fingerprint(ckpt["model"])
    out = []
    for r in rows:
        step = int(r["step"])
        logged_by = [s for s in sessions if s["from_step"] < step or s["from_step"] == step == total]
        if not logged_by:
            raise ValueError(f"{run / 'ckpt.pt'} does not record where step {r['step']} was trained (written by "
                             "a trainer that did not record it): train the run again")
        prov = {k: v for k, v in logged_by[-1].items() if k != "from_step"}
        out.append({**r, "run": label or str(run), "weights": weights, **prov})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.training.records",
                                 description="Write a finished training run's metrics.csv as a results CSV: "
                                             "each row with the run's label, its weights' fingerprint and the "
                                             "provenance of the process that trained that step.")
    ap.add_argument("run", help="the trainer's --out folder (ckpt.pt, metrics.csv)")
    ap.add_argument("--out", required=True, help="the CSV to write")
    ap.add_argument("--label", help="the run column (default: RUN)")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)

    def body():
        out = Path(a.out)
        if out.is_dir():
            raise ValueError(f"--out {a.out} is a directory; give a file")
        if out.resolve().parent == Path(a.run).resolve() and out.name in RUN_FILES:
            raise ValueError(f"refusing to write {a.out}: it is the run's own {out.name} (even with --force)")
        if out.exists() and not a.force:
            raise ValueError(f"refusing to write {a.out}: the file exists (--force replaces it)")
        rows = run_rows(a.run, a.label)
        _write_rows(a.out, rows)
        print(f"{a.out}: {len(rows)} rows of {a.run} (weights {rows[0]['weights']})")
    run_command(body)


if __name__ == "__main__":
    main()
