"""Progressive growth as one run: ``python -m fractus.train --schedule palier0:3M,palier1:6M …``.

A schedule is a list of stages ``PRESET:TOKENS[:lr=LR][:warmup=STEPS]``; each stage trains its
preset for TOKENS tokens (K, M, G suffixes) in its own run directory ``OUT/<i>-<preset>``, and each
stage after the first starts from the previous stage's final checkpoint grown to its preset
(:mod:`fractus.grow`: the same logits) with a fresh optimizer. Every other flag applies to every
stage. A grown stage's default warm-up is :data:`GROWN_WARMUP` steps rather than the first stage's
``--warmup``: its weights are trained already, and only the fresh optimizer's moment estimates need
a few steps to settle; its learning rate defaults to ``--lr`` (the model's tuned rate).

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
from fractus.grow import check_growable
from fractus.model import FractusCTE
from fractus.training.loop import run
from fractus.cli import natural
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


def parse_schedule(text: str) -> list[Stage]:
    """``PRESET:TOKENS[:lr=LR][:warmup=STEPS],…`` → stages; ValueError naming a bad stage. A stage's
    rate passes the checks ``--lr`` does (finite, 0 … :data:`fractus.training.options.MAX_RATE`)
    and each option is given at most once."""
    types = {"lr": rate, "warmup": natural}
    stages = []
    for part in text.split(","):
        fields = part.strip().split(":")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", fields[1].strip().upper()) if len(fields) >= 2 else None
        if not m or not fields[0]:
            raise ValueError(f"--schedule: stage {part!r} must read PRESET:TOKENS[:lr=LR][:warmup=STEPS], "
                             f"e.g. palier0:3M")
        opts = {}
        for opt in fields[2:]:
            key, _, value = opt.partition("=")
            if key not in types:
                raise ValueError(f"--schedule: stage {part!r}: {opt!r} is not lr=LR or warmup=STEPS")
            if key in opts:
                raise ValueError(f"--schedule: stage {part!r} gives {key} twice")
            try:
                opts[key] = types[key](value)
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(f"--schedule: stage {part!r}: {key} {e}") from None
        tokens = int(float(m.group(1)) * SUFFIX[m.group(2)])
        if tokens < 1:
            raise ValueError(f"--schedule: stage {part!r} needs tokens ≥ 1")
        stages.append(Stage(fields[0], tokens, opts.get("lr"), opts.get("warmup")))
    return stages


def stage_args(args: argparse.Namespace, stages: list[Stage], i: int) -> argparse.Namespace:
    """The trainer's arguments of stage ``i``."""
    s, out = stages[i], Path(args.out)
    a = copy.copy(args)
    a.schedule, a.preset, a.tokens, a.out = None, s.preset, s.tokens, str(stage_dir(out, stages, i))
    a.lr = s.lr if s.lr is not None else args.lr
    a.warmup = s.warmup if s.warmup is not None else (args.warmup if i == 0 else GROWN_WARMUP)
    a.grow_from = str(stage_dir(out, stages, i - 1) / "ckpt.pt") if i else args.grow_from
    a.resume = (Path(a.out) / "ckpt.pt").exists()
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
    one (unparsable, or not {"schedule": [stages]})."""
    try:
        saved = json.loads(path.read_text())
        if not (isinstance(saved, dict) and isinstance(saved.get("schedule"), list)
                and all(isinstance(s, dict) for s in saved["schedule"])):
            raise ValueError("not a schedule's record")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}): it cannot say which schedule --resume continues; "
                         "start the schedule again in another --out") from None
    return saved


def run_schedule(args: argparse.Namespace) -> dict:
    """Train every stage of ``args.schedule`` in turn (see the module's docstring); returns the last
    stage's final metrics. Raises as the trainer does (a stop by a signal: after saving)."""
    stages = parse_schedule(args.schedule)
    out = Path(args.out)
    active = check_schedule(args, stages)
    plan = {"schedule": [vars(s) for s in stages]}
    with run_lock(out):
        remove_leftover_temps([out / "metrics.csv", out / "schedule.json"])
        if args.resume:
            if not (out / "schedule.json").exists():
                raise FileNotFoundError(f"--resume: no schedule.json in {out}")
            saved = saved_schedule(out / "schedule.json")
            if saved != plan:
                raise ValueError(f"--resume with another schedule than {out}'s: {saved['schedule']} vs {plan['schedule']}")
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
