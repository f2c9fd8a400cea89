"""What every experiment runner (the comparison, growth, the recall grid, the ablation) shares, so
that each kind of fault is met once:

- :func:`read_results`: a runner's results CSV, refused with a message naming it when it is not
  one (another runner's CSV, a damaged file) rather than failing on a missing column later;
- :func:`held`: one runner at a time on a results CSV and on a runs folder (a second one is
  refused at once; two runners on one CSV would train and write the same runs twice);
- :class:`Workers`: jobs in spawned processes that stop on Ctrl-C or SIGTERM: the jobs not started
  are dropped, the running ones are interrupted (a training run saves its checkpoint and stops, so
  that the rerun resumes it) and the runner exits 130 / 143;
- :func:`main`: a runner's body as a command — one ``error:`` line for a bad input, 128 + the
  signal's number for a stop.

A runner writes each run's rows whole, in one atomic replace of its CSV
(:func:`fractus.training.records.append_csv` with the run's key as ``replace``): a run is in the
CSV with all its rows or not at all.
"""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import pandas as pd

from fractus.cli import run_command
from fractus.training.runs import RunInUse, run_lock
from fractus.training.stopping import Interrupted, NonFiniteLoss

STOPPED = "interrupted: finished runs are in the CSV; a stopped one resumes from its run directory"


def read_results(path, columns, what: str) -> pd.DataFrame:
    """The rows of the results CSV at ``path`` (none if it does not exist or is empty); ValueError
    naming it unless it is a CSV that holds every one of ``columns`` (``what``: whose CSV it is)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame(columns=list(columns))
    try:
        rows = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a CSV file ({str(e).strip()}): give another --csv") from None
    missing = [c for c in columns if c not in rows.columns]
    if missing:
        raise ValueError(f"{path} is not a results CSV of {what}: it lacks the column(s) {', '.join(missing)}; "
                         "give another --csv")
    return rows


@contextlib.contextmanager
def held(csv, runs=None):
    """Hold ``csv`` (a lock file ``.NAME.lock`` beside it) and the folder ``runs`` (its ``.lock``)
    for this runner until the block ends; :class:`fractus.training.runs.RunInUse` at once if
    another runner holds either. The OS drops the locks when the process dies."""
    csv = Path(csv)
    csv.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(csv.with_name(f".{csv.name}.lock"), "a"))
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(f"{csv} is being written by another runner: wait for it to end, or give another "
                           "--csv") from None
        if runs is not None:
            stack.enter_context(run_lock(Path(runs), "--runs"))
        yield


_STOPPING = None  # in a worker: the runner's event "stop", set before it interrupts its workers


class Cancelled(Exception):
    """A job a worker took from the queue after its runner had begun to stop: not started."""


def _idle_worker(stopping) -> None:
    global _STOPPING
    _STOPPING = stopping
    # a Ctrl-C reaches every process of the terminal's group: an idle worker lets the runner decide
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _job(fn, args):
    # a running job is interrupted by SIGINT (the trainer turns it into a saved stop); idle again after.
    # The handler first, then the event: a SIGINT the runner sent before this job took the handler
    # was sent after the event was set, so the job is not started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if _STOPPING is not None and _STOPPING.is_set():
            raise Cancelled("the runner is stopping")
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _terminated(signum, frame):
    raise Interrupted(signum)


class Workers:
    """``n`` spawned processes that run jobs (``submit``) and hand back their results as they end
    (``done``). Leaving the block by an exception — Ctrl-C (KeyboardInterrupt), SIGTERM (raised
    here as :class:`fractus.training.stopping.Interrupted`), a job's failure — cancels the jobs not
    started (those already queued to a worker too) and sends SIGINT to the running ones, then waits
    for them: a trainer saves its checkpoint before it stops, and no new run starts."""

    def __init__(self, n: int):
        self.n = n
        self.pending: dict = {}

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stopping = ctx.Event()
        self.pool = ProcessPoolExecutor(self.n, mp_context=ctx, initializer=_idle_worker, initargs=(self.stopping,))
        self._old_term = signal.signal(signal.SIGTERM, _terminated)
        return self

    def submit(self, tag, fn, *args) -> None:
        """Run ``fn(*args)`` in a worker; ``tag`` comes back with its result."""
        self.pending[self.pool.submit(_job, fn, args)] = tag

    def done(self):
        """(tag, result) of each job as it ends, until none is pending (jobs submitted meanwhile
        included); a job's exception is raised here."""
        while self.pending:
            finished, _ = wait(self.pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                yield self.pending.pop(fut), fut.result()

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None:
                self.stopping.set()  # a job already queued to a worker is not started (Cancelled)
                running = [f for f in self.pending if not f.cancel()]
                if running:
                    for p in mp.active_children():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p.pid, signal.SIGINT)
            self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)
        finally:
            signal.signal(signal.SIGTERM, self._old_term)


def main(body, interrupted: str = STOPPED) -> None:
    """Run ``body()`` as a runner's command (:func:`fractus.cli.run_command`): a bad input, a CSV or
    runs folder in use, a run that cannot go on: ``error: …``, exit 2; stopped by SIGINT or SIGTERM
    (here or in a training run): ``interrupted`` on stderr, exit 130 / 143."""
    def guarded():
        try:
            body()
        except Interrupted as e:
            print(interrupted, file=sys.stderr)
            sys.exit(128 + e.signum)
    run_command(guarded, errors=(NonFiniteLoss, RunInUse), interrupted=interrupted)
