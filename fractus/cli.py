"""What the command-line tools share: argparse types (bounded finite numbers, a usable device,
a seed) and :func:`run_command`, the one way every tool reports errors, Ctrl-C and a closed pipe."""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from fractus.checkpoint import CheckpointError


def number(kind: type, test, what: str):
    """An argparse type: a ``kind`` that passes ``test`` (``what`` says how), finite if a float."""
    def parse(text: str):
        x = kind(text)
        if not (math.isfinite(x) and test(x)):
            raise argparse.ArgumentTypeError(f"must be {'finite and ' * (kind is float)}{what}, got {text}")
        return x
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse


positive_int = number(int, lambda n: n >= 1, "≥ 1")
natural = number(int, lambda n: n >= 0, "≥ 0")
non_negative = number(float, lambda x: x >= 0, "≥ 0")
MAX_SEED = 2 ** 32 - 1
seed_number = number(int, lambda n: 0 <= n <= MAX_SEED, f"in [0, {MAX_SEED}]")


def device_name(text: str) -> str:
    """An argparse type: a device this torch can use (kept as its name)."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda, cuda:N)") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise argparse.ArgumentTypeError(f"{text!r} is not available here (this torch sees "
                                         f"{torch.cuda.device_count()} CUDA device(s))")
    return text


class CommandError(Exception):
    """A failure a command reports as one line (``error: …``, exit 2) rather than a traceback."""


def run_command(body, errors: tuple = (), interrupted: str = "interrupted") -> None:
    """Run ``body()`` as a command-line tool's ``main``, with one discipline for every tool:

    - a bad input or a failed read or write (ValueError, OSError — a full disk, a missing file —,
      :class:`fractus.checkpoint.CheckpointError`, :class:`CommandError`, ``errors``): ``error: …``
      on stderr, exit 2;
    - Ctrl-C: ``interrupted`` on stderr, exit 130 (128 + SIGINT), no traceback;
    - a reader that closed standard output (``… | head``): quietly, exit 141 (128 + SIGPIPE), as a
      tool killed by SIGPIPE.
    What a tool wrote is written atomically, so none of these leaves a half-written file."""
    try:
        body()
        sys.stdout.flush()  # a closed pipe shows here at the latest
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's own flush at exit would fail again
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        sys.exit(130)
    except (ValueError, OSError, CheckpointError, CommandError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
