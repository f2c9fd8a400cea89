"""How a training run stops short: the exceptions both trainers (:mod:`fractus.training.loop`,
:mod:`fractus.vision`) and a schedule of runs (:mod:`fractus.training.schedule`) raise, and
:class:`Stop`, which turns SIGINT/SIGTERM into a request the loop answers after its step.

One definition of each class, here, so that whoever catches them (the command line's ``main``, the
GPU suite, an experiment) catches what any run raised. :class:`fractus.training.runs.RunInUse`
(a run directory locked by another run) lives beside the lock that raises it.
"""
from __future__ import annotations

import signal

RESUME_HINT = "interrupted; --resume continues from the last checkpoint, if one was written"


class NonFiniteLoss(RuntimeError):
    """Training cannot go on: non-finite losses (the trainer's ``--max-nan`` steps in a row, the
    vision trainer's first) or weights that became non-finite; the last checkpoint stays."""


class Interrupted(BaseException):
    """Training stopped by a signal (this process's ``signum``, else SIGTERM: a peer's), after the
    checkpoint was saved. A BaseException, as KeyboardInterrupt: ``except Exception`` lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """Set by SIGINT/SIGTERM: the trainer finishes its step, saves and exits. A SIGTERM that a
    caller's own Python handler was waiting for (e.g. the GPU suite's) is handed on to it then."""

    def __init__(self):
        self.requested = False
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested, self.signum = True, signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        old = self._old.get(self.signum)
        if self.signum == signal.SIGTERM and callable(old):
            old(self.signum, None)

