"""Progressive growth as one run: ``python -m fractus.train --schedule palier0:3M,palier1:6M …``.

A schedule is a list of stages ``PRESET:TOKENS[:lr=LR][:warmup=STEPS][:depth=DEPTH]``; each stage
trains its preset for TOKENS tokens (K, M, G suffixes) in its own run directory ``OUT/<i>-<preset>``,
and each stage after the first starts from the previous stage's final checkpoint grown to its
preset (:mod:`fractus.grow`; ``depth=interleave``, the default, keeps the logits, ``depth=stack``
repeats the trained blocks) with a fresh optimizer. Every other flag applies to every stage. A
grown stage's default warm-up is :data:`GROWN_WARMUP` steps rather than the first stage's
``--warmup``: its weights are trained already, and only the fresh optimizer's moment estimates need
a few steps to settle; its learning rate defaults to ``--lr`` (the model's tuned rate).

The rate: with ``--stage-lr restart`` (the default) each stage runs its own curve (``--lr-shape``
over its own steps, from its warm-up); with ``--stage-lr continue`` the stages share one curve over
the whole schedule's steps, which the first stage's warm-up starts, and each stage reads it where
it stands (its peak rate times the curve's value), a grown stage ramping up to it over its warm-up.

``OUT/metrics.csv`` is the one record of the whole schedule: every stage's rows with a ``stage``
and a ``preset`` column, ``tokens`` and ``flops`` counted from the schedule's start (training
FLOPs as 6 · active parameters per token). ``OUT/schedule.json`` records the schedule; ``--resume``
refuses another one, skips the stages that finished, and resumes the stage that was stopped or
killed exactly as a single run resumes. The schedule holds a lock on ``OUT`` as a run does on its
directory.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fractus.atomic import atomic_open
from fractus.data import load_meta
from fractus.grow import DEPTHS, check_growable
from fractus.model import FractusCTE
from fractus.training.loop import run
from fractus.cli import natural
from fractus.training.optim import warmup_steps
from fractus.training.options import make_config, rate
from fractus.training.runs import (METRIC_FIELDS, clear_unstarted, planned_steps, read_metrics,
                                  remove_leftover_temps, run_lock)

GROWN_WARMUP = 10  # warm-up steps of a grown stage (a fresh optimizer on trained weights)
SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
COLUMNS = ("stage", "preset", *METRIC_FIELDS, "stage_tokens", "flops")


@dataclass(frozen=True)
class Stage:
    preset: str
    tokens: int
    lr: float | None = None  # None: --lr (the model's tuned rate)
    warmup: int | None = None  # None: --warmup for the first stage, GROWN_WARMUP after
    depth: str | None = None  # how this stage grows from the one before (fractus.grow.DEPTHS); None: interleave


def parse_schedule(text: str) -> list[Stage]:
    """``PRESET:TOKENS[:lr=LR][:warmup=STEPS][:depth=DEPTH],…`` → stages; ValueError naming a bad
    stage. A stage's rate passes the checks ``--lr`` does (finite, 0 …
    :data:`fractus.training.options.MAX_RATE`), a depth is one of :data:`fractus.grow.DEPTHS` and
    not the first stage's, and each option is given at most once."""
    types = {"lr": rate, "warmup": natural, "depth": depth_kind}
    stages = []
    for part in text.split(","):
        fields = part.strip().split(":")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", fields[1].strip().upper()) if len(fields) >= 2 else None
        if not m or not fields[0]:
            raise ValueError(f"--schedule: stage {part!r} must read PRESET:TOKENS[:lr=LR][:warmup=STEPS]"
                             f"[:depth=DEPTH], e.g. palier0:3M")
        opts = {}
        for opt in fields[2:]:
            key, _, value = opt.partition("=")
            if key not in types:
                raise ValueError(f"--schedule: stage {part!r}: {opt!r} is not lr=LR, warmup=STEPS or depth=DEPTH")
            if key in opts:
                raise ValueError(f"--schedule: stage {part!r} gives {key} twice")
            try:
                opts[key] = types[key](value)
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(f"--schedule: stage {part!r}: {key} {e}") from None
        tokens = int(float(m.group(1)) * SUFFIX[m.group(2)])
        if tokens < 1:
            raise ValueError(f"--schedule: stage {part!r} needs tokens ≥ 1")
        if "depth" in opts and not stages:
            raise ValueError(f"--schedule: stage {part!r} is the first: it grows from nothing, so it takes no depth")
        stages.append(Stage(fields[0], tokens, opts.get("lr"), opts.get("warmup"), opts.get("depth")))
    return stages


def depth_kind(text: str) -> str:
    if text not in DEPTHS:
        raise ValueError(f"must be one of {', '.join(DEPTHS)}")
    return text


def stage_args(args: argparse.Namespace, stages: list[Stage], i: int) -> argparse.Namespace:
    """The trainer's arguments of stage ``i``."""
    s, out = stages[i], Path(args.out)
    a = copy.copy(args)
    a.schedule, a.preset, a.tokens, a.out = None, s.preset, s.tokens, str(stage_dir(out, stages, i))
    a.lr = s.lr if s.lr is not None else args.lr
    a.warmup = s.warmup if s.warmup is not None else (args.warmup if i == 0 else GROWN_WARMUP)
    a.grow_from = str(stage_dir(out, stages, i - 1) / "ckpt.pt") if i else args.grow_from
    a.grow_depth = (s.depth or "interleave") if i else args.grow_depth
    a.resume = (Path(a.out) / "ckpt.pt").exists()
    if args.stage_lr == "continue":  # this stage's part of the schedule's one curve
        steps = [planned_steps({**vars(args), "tokens": t.tokens}, 1) for t in stages]
        a.lr_offset, a.lr_span = sum(steps[:i]), sum(steps)
        a.lr_decay_start = warmup_steps(args.warmup, steps[0]) if stages[0].warmup is None else stages[0].warmup
    return a


def stage_dir(out: Path, stages: list[Stage], i: int) -> Path:
    return Path(out) / f"{i}-{stages[i].preset}"


def finished(args: argparse.Namespace) -> bool:
    """Whether the stage run ``args`` reached its last step and recorded its final validation."""
    rows = read_metrics(Path(args.out) / "metrics.csv")
    return bool(rows) and int(rows[-1]["step"]) >= planned_steps(vars(args), 1) and rows[-1]["val_ce"] != ""


def check_schedule(args: argparse.Namespace, stages: list[Stage]) -> list[int]:
    """ValueError unless every stage can grow into the next (same data vocabulary, growable
    configs); each stage's active parameters per token."""
    if args.model != "cte":
        raise ValueError("--schedule grows the Fractus CTE; growth is not defined for --model transformer")
    if args.resume and args.grow_from:
        raise ValueError("--schedule with --resume continues the schedule in --out; leave out --grow-from")
    vocab = load_meta(args.data)["vocab_size"]
    cfgs = [make_config(stage_args(args, stages, i), vocab) for i in range(len(stages))]
    for i in range(1, len(stages)):
        try:
            check_growable(cfgs[i - 1], cfgs[i])
        except ValueError as e:
            raise ValueError(f"--schedule: stage {i - 1} ({stages[i - 1].preset}) cannot grow into stage {i} "
                             f"({stages[i].preset}): {e}") from None
    with torch.device("meta"):  # counted, not allocated
        return [FractusCTE(c).num_params(active=True) for c in cfgs]


def write_record(out: Path, stages: list[Stage], models_active: list[int]) -> None:
    """``out/metrics.csv``: every stage's rows so far, tokens and FLOPs counted from the start."""
    rows, tokens0, flops0 = [], 0, 0.0
    for i, s in enumerate(stages):
        stage_rows = read_metrics(stage_dir(out, stages, i) / "metrics.csv")
        per_token = 6.0 * models_active[i]
        for r in stage_rows:
            t = int(r["tokens"])
            rows.append({**r, "stage": i, "preset": s.preset, "stage_tokens": t, "tokens": tokens0 + t,
                         "flops": flops0 + per_token * t})
        if not stage_rows:
            break
        last = int(stage_rows[-1]["tokens"])
        tokens0, flops0 = tokens0 + last, flops0 + per_token * last
    with atomic_open(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)


def saved_schedule(path: Path) -> dict:
    """The schedule ``path`` (``OUT/schedule.json``) records; ValueError naming it when it is not
    one (unparsable, or not {"schedule": [stages], …}). A record without a stage's depth or the
    ``--stage-lr`` reads as the defaults."""
    try:
        saved = json.loads(path.read_text())
        if not (isinstance(saved, dict) and isinstance(saved.get("schedule"), list)
                and all(isinstance(s, dict) for s in saved["schedule"])):
            raise ValueError("not a schedule's record")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}): it cannot say which schedule --resume continues; "
                         "start the schedule again in another --out") from None
    saved.setdefault("stage_lr", "restart")
    for s in saved["schedule"]:
        s.setdefault("depth", None)
    return saved


def run_schedule(args: argparse.Namespace) -> dict:
    """Train every stage of ``args.schedule`` in turn (see the module's docstring); returns the last
    stage's final metrics. Raises as the trainer does (a stop by a signal: after saving)."""
    stages = parse_schedule(args.schedule)
    out = Path(args.out)
    active = check_schedule(args, stages)
    plan = {"schedule": [vars(s) for s in stages], "stage_lr": args.stage_lr}
    with run_lock(out):
        remove_leftover_temps([out / "metrics.csv", out / "schedule.json"])
        if args.resume:
            if not (out / "schedule.json").exists():
                raise FileNotFoundError(f"--resume: no schedule.json in {out}")
            saved = saved_schedule(out / "schedule.json")
            if saved != plan:
                raise ValueError(f"--resume with another schedule than {out}'s: {saved} vs {plan}")
        elif (out / "schedule.json").exists():
            raise FileExistsError(f"{out / 'schedule.json'} exists: pass --resume to continue that schedule, or "
                                  "choose another --out")
        with atomic_open(out / "schedule.json") as f:
            f.write(json.dumps(plan, indent=1))
        last = {}
        for i in range(len(stages)):
            if args.resume:
                clear_unstarted(stage_dir(out, stages, i))
            a = stage_args(args, stages, i)
            if a.resume and finished(a):
                print(f"stage {i} ({stages[i].preset}): finished, kept")
                continue
            print(f"stage {i} ({stages[i].preset}, {stages[i].tokens:,} tokens"
                  f"{', grown from ' + a.grow_from if i else ''})")
            try:
                with contextlib.ExitStack() as held:
                    last = run(a, held)
            finally:
                write_record(out, stages, active)
            if not finished(a):  # --stop-after: the schedule stops with its stage
                break
        write_record(out, stages, active)  # the record again from the stages' own (a damaged one is replaced)
    return last
