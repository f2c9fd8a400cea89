"""What ``python -m fractus.train`` runs: :func:`train` (the parsed arguments to a schedule of runs
with ``--schedule``, else to one run) and :func:`main` (the same, with the command line's exit
codes). The experiments and the GPU suite call :func:`train` with a command line of their own.
"""
from __future__ import annotations

import contextlib
import sys

from fractus.allocator import keep_freed_memory
from fractus.cli import run_command
from fractus.training.loop import run
from fractus.training.options import build_parser
from fractus.training.runs import RunInUse
from fractus.training.schedule import run_schedule
from fractus.training.stopping import RESUME_HINT, Interrupted, NonFiniteLoss


def train(argv=None) -> dict:
    """``python -m fractus.train ARGV`` in this process: a schedule of runs (``--schedule``) or one
    run; returns the last run's final metrics. Raises :class:`Interrupted` after a SIGINT/SIGTERM
    stop (checkpoint saved; ``main`` exits with 128 + the signal's number)."""
    args = build_parser().parse_args(argv)
    if args.schedule is not None:  # '' too: parse_schedule refuses it
        return run_schedule(args)
    if args.stage_lr != "restart":
        raise ValueError("--stage-lr sets how a --schedule's stages share the rate: give a --schedule")
    with contextlib.ExitStack() as held:  # the run directory's lock (rank 0), released however the run ends
        return run(args, held)


def main(argv=None) -> None:
    """:func:`train` as a command: after a SIGINT/SIGTERM stop (saved) it exits with 128 + the
    signal's number; a bad input or a run that cannot go on is one ``error:`` line (exit 2), Ctrl-C
    outside the training loop exits 130 (:func:`fractus.cli.run_command`)."""
    keep_freed_memory()

    def body():
        try:
            train(argv)
        except Interrupted as e:  # saved; not 0, so that `train && evaluate` does not go on
            sys.exit(128 + e.signum)
    # Ctrl-C outside the training loop (set-up, final validation, samples): RESUME_HINT
    run_command(body, errors=(NonFiniteLoss, RunInUse), interrupted=RESUME_HINT)

