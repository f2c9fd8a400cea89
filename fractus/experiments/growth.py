"""What progressive growth buys: a grown model against the same preset trained from scratch.

Two paths, each one ``--schedule`` run of the trainer (:mod:`fractus.training.schedule`) on the same
prepared tokens, read and scored the same way:

- ``grown``: the small preset, then grown into the target and trained on, in one of several
  configs (:data:`ROUND1`, :data:`ROUND2`: the grown stage's rate and warm-up, one rate curve
  across the stages or one each, when to grow, the growth operator);
- ``scratch``: the target preset from a fresh initialisation.

Both validate on the whole held-out split every ``eval_every`` steps, so that each path is a curve
of validation CE against cumulative training FLOPs (6 · active parameters per token, summed over
the stages) and training time. :func:`saving` reads the curves: the FLOPs at which the grown path
first reaches the scratch path's final CE, as a fraction of the scratch path's FLOPs (below 1:
growth saves compute; NaN: the grown path never gets there); :func:`ranking` orders the configs by
it. :func:`jump` measures where a grown model loses the function growth kept: its CE before any
update and after a few steps.

``python -m fractus.experiments.growth sweep|jump|search|seeds --data DIR``: ``sweep`` trains the
target from scratch at each of a few peak rates on a short budget (its tuned rate), ``jump`` the
steps after growth, ``search`` every config from one seed (round 2 on round 1's best), ``seeds`` the
best configs from :data:`BEST_SEEDS`. Every run resumes in its directory under ``--runs``; every
finished run's evaluations are rows of ``--csv`` (``results/growth_cpu.csv``) with provenance,
written whole, and a run whose rows are there is not trained again (:mod:`.runner`). A row's ``lr``
is the run's ``--lr``, the target's rate; a stage whose schedule names its own rate (the grown
path's small stage: ``lr=…`` in ``schedule``) trains at that.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fractus.atomic import atomic_open
from fractus.experiments import runner
from fractus.experiments.convergence import CE_TOL, settled
from fractus.training.records import append_csv
from fractus.training.optim import default_lr
from fractus.training.runs import read_metrics
from fractus.training.schedule import parse_schedule

SMALL, TARGET = "palier0", "palier1"
SMALL_LR = default_lr("adamw", "cte", SMALL)  # the small stage at its own tuned rate
SWEEP = {"schedule": f"{TARGET}:1.5M", "lrs": (1.5e-3, 3e-3, 6e-3)}
SEEDS = (0, 1)  # the restart path against scratch
BEST_SEEDS = (0, 1, 2)  # the search's best configs against scratch
READING = ["--batch-size", "32", "--chunk-len", "64", "--accum", "1"]  # 2,048 tokens a step: 32 windows of 64
COLUMNS = ("config", "path", "schedule", "flags", "stage", "preset", "tokens", "flops", "lr", "seed", "val_ce",
           "val_bpb", "wall_s")


@dataclass(frozen=True)
class Job:
    """One run: ``config`` names it (a row's ``config``), ``path`` is "grown" or "scratch", and
    ``schedule`` and ``flags`` are what the trainer is given beside the common ones, at peak rate
    ``lr`` (every stage whose schedule names none) from ``seed``."""
    config: str
    path: str
    schedule: str
    lr: float
    seed: int
    flags: tuple = ()


def grown(lr: float, small: str = "3M", rate: float = 1.0, warmup: int | None = None, depth: str | None = None,
          target: str = "4M", presets: tuple[str, str] = (SMALL, TARGET)) -> str:
    """The grown path's schedule: ``SMALL`` (``presets[0]``) for ``small`` tokens at its tuned rate,
    grown into ``TARGET`` (``presets[1]``) for ``target`` tokens at ``rate`` × ``lr`` (the target's
    tuned rate) with ``warmup`` steps (default: the schedule's) and growth operator ``depth``
    (default: interleave)."""
    opts = (f":lr={rate * lr:g}" if rate != 1 else "") + (f":warmup={warmup}" if warmup is not None else "") \
        + (f":depth={depth}" if depth else "")
    return f"{presets[0]}:{small}:lr={SMALL_LR:g},{presets[1]}:{target}{opts}"


def scratch(lr: float, seed: int, config: str = "scratch", schedule: str = f"{TARGET}:6M") -> Job:
    return Job(config, "scratch", schedule, lr, seed)


def sweep_config(schedule: str) -> str:
    """The sweep's config name: "scratch TOKENS"."""
    return f"scratch {schedule.split(':')[1]}"


def sweep_jobs(schedule: str, lrs, seed: int) -> list[Job]:
    """The target from scratch on ``schedule`` at each rate of ``lrs``."""
    return [Job(sweep_config(schedule), "scratch", schedule, lr, seed) for lr in lrs]


# The search's first round: the grown stage's peak rate and warm-up with each stage on its own
# rate curve (restart), and one curve across the stages (continue: cosine, or warmup-stable-decay)
ROUND1 = {
    "restart": {},  # the target's rate, 10 steps of warm-up (the schedule's default)
    "restart 0.5x": {"rate": 0.5},
    "restart 0.25x": {"rate": 0.25},
    "restart, warm-up 100": {"warmup": 100},
    "restart 0.5x, warm-up 100": {"rate": 0.5, "warmup": 100},
    "continue": {"flags": ("--stage-lr", "continue")},
    "continue wsd": {"flags": ("--stage-lr", "continue", "--lr-shape", "wsd")},
}
# the second round, on the first round's best: when to grow, and depth by stacking the trained blocks
ROUND2 = {"grown at 0.5M": {"small": "0.5M"}, "grown at 1M": {"small": "1M"}, "stacked": {"depth": "stack"},
          "grown at 0.25M": {"small": "0.25M"}}  # 0.5M did best of 3M, 1M, 0.5M: the bracket below it


def search_job(config: str, lr: float, seed: int, best: str | None = None, round2: dict = ROUND2, **sizes) -> Job:
    """The search's ``config`` (a name of :data:`ROUND1`, or ``f"{best}, {name}"`` for a name of
    ``round2`` on round 1's ``best``) as a job; ``sizes``: :func:`grown`'s ``small``, ``target``
    and ``presets`` where not the search's own (a smaller search, as the notebook's smoke run)."""
    opts = {**sizes, **(ROUND1[best] if best else ROUND1[config])}
    if best:
        opts.update(round2[config])
        config = f"{best}, {config}"
    flags = opts.pop("flags", ())
    return Job(config, "grown", grown(lr, **opts), lr, seed, tuple(flags))


def search(data, csv_path: Path, runs: Path, lr: float, seed: int = 0, eval_every: int = 250, threads: int = 2,
           log=print, reading: list[str] = READING, scratch_job=scratch, round2: dict = ROUND2,
           **sizes) -> tuple[pd.DataFrame, str]:
    """The search on ``seed``: the scratch path (``scratch_job(lr, seed)``) and each config of
    :data:`ROUND1`, then each of ``round2`` on round 1's best (:func:`ranking`); trains what
    ``csv_path`` lacks. Returns the CSV's rows and round 1's best config."""
    base = scratch_job(lr, seed)
    rows = run([base] + [search_job(c, lr, seed, **sizes) for c in ROUND1], data, csv_path, runs, eval_every,
               threads, log, reading)
    first = ranking(rows[(rows["seed"] == seed) & (rows["lr"] == lr) & rows["config"].isin([base.config, *ROUND1])],
                    base.config)
    best = first["config"].iloc[0]
    rows = run([search_job(c, lr, seed, best, round2, **sizes) for c in round2], data, csv_path, runs, eval_every,
               threads, log, reading)
    return rows, best


def best_seeds(data, csv_path: Path, runs: Path, lr: float, seeds=BEST_SEEDS, best: int = 2, eval_every: int = 250,
               threads: int = 2, log=print, reading: list[str] = READING,
               scratch_job=scratch) -> tuple[pd.DataFrame, list[str]]:
    """The search's ``best`` configs (:func:`ranking` of its seed-``SEEDS[0]`` runs at ``lr``) and
    the scratch path from each of ``seeds``; trains what ``csv_path`` lacks. Returns the CSV's rows
    and the configs."""
    rows = read_rows(csv_path)
    top = list(ranking(rows[(rows["seed"] == SEEDS[0]) & (rows["lr"] == lr)])["config"].iloc[:best])
    jobs = [j for s in seeds for j in [scratch_job(lr, s)] + [job_of(rows, c, lr, s) for c in top]]
    return run(jobs, data, csv_path, runs, eval_every, threads, log, reading), top


def run_dir(runs: Path, job: Job) -> Path:
    name = re.sub(r"[^A-Za-z0-9.]+", "_", job.config).strip("_")
    return Path(runs) / f"{job.path}-{name}-{job.schedule.replace(':', '_').replace(',', '+')}-lr{job.lr:g}-seed{job.seed}"


def train_path(job: Job, data, runs: Path, eval_every: int, threads: int = 2,
               reading: list[str] = READING) -> list[dict]:
    """Train ``job`` (resuming its directory if it was stopped; its first stage copied from another
    run's where that stage is the same run: :func:`share_first_stage`); one row per validation, CE
    on the whole held-out split."""
    from fractus.training.command import train
    out = run_dir(runs, job)
    common = ["--data", str(data), "--lr", repr(job.lr), "--seed", str(job.seed), "--eval-every", str(eval_every),
              "--eval-tokens", str(10 ** 12), "--sample-tokens", "0", "--no-progress", *reading]
    if not (out / "schedule.json").exists():
        share_first_stage(job, runs, common)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_open(out / "job.json") as f:
            f.write(json.dumps({"job": asdict(job), "common": common}))
    train(["--schedule", job.schedule, "--out", str(out), "--threads", str(threads), *common, *job.flags]
          + (["--resume"] if (out / "schedule.json").exists() else []))
    return curve(out / "metrics.csv", job)


def first_stage(job: Job) -> tuple | None:
    """What makes a grown job's first stage the run it is (its stage, seed, rate, flags), or None
    when its stages share one rate curve (the first stage's rate then depends on the others)."""
    if job.path != "grown" or "continue" in job.flags:
        return None
    return job.schedule.split(",")[0], job.seed, job.lr, tuple(job.flags)


def share_first_stage(job: Job, runs: Path, common: list[str]) -> None:
    """Copy into ``job``'s fresh directory the finished first stage of another run under ``runs``
    whose first stage is the same run (:func:`first_stage`, the same common flags): the schedule
    then keeps it instead of training it again (a stage whose record ends at its last step's
    validation is finished)."""
    key = first_stage(job)
    if key is None:
        return
    stage0 = f"0-{parse_schedule(job.schedule)[0].preset}"
    for other in sorted(Path(runs).glob("*/job.json")):
        src = other.parent / stage0
        try:
            saved = json.loads(other.read_text())
            twin = Job(**{**saved["job"], "flags": tuple(saved["job"]["flags"])})
        except (ValueError, TypeError, KeyError):
            continue  # not a record this function wrote: not a twin
        if other.parent == run_dir(runs, job) or first_stage(twin) != key or saved["common"] != common:
            continue
        rows = read_metrics(src / "metrics.csv") if (src / "ckpt.pt").exists() else []
        if not rows or not rows[-1]["val_ce"] or int(rows[-1]["tokens"]) < parse_schedule(job.schedule)[0].tokens:
            continue
        dst = run_dir(runs, job) / stage0
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("ckpt.pt", "metrics.csv"):
            with open(src / f, "rb") as i, atomic_open(dst / f, "wb") as o:
                shutil.copyfileobj(i, o)
        return


def curve(record: Path, job: Job) -> list[dict]:
    """The validations of a schedule's record (``OUT/metrics.csv``) as rows, ``wall_s`` the training
    time from the schedule's start (each stage's elapsed time added to the stages' before it)."""
    with open(record, newline="") as f:
        rows = list(csv.DictReader(f))
    out, before, stage, stage_end = [], 0.0, None, 0.0
    for r in rows:
        if r["stage"] != stage:
            before, stage = before + stage_end, r["stage"]
        stage_end = float(r["elapsed_s"])
        if r["val_ce"]:
            out.append({"config": job.config, "path": job.path, "schedule": job.schedule, "flags": " ".join(job.flags),
                        "stage": int(r["stage"]), "preset": r["preset"], "tokens": int(r["tokens"]),
                        "flops": float(r["flops"]), "lr": job.lr, "seed": job.seed, "val_ce": float(r["val_ce"]),
                        "val_bpb": float(r["val_bpb"]), "wall_s": before + stage_end})
    return out


RUN_KEY = ("config", "lr", "seed")  # a run's rows in the CSV


def read_rows(csv_path) -> pd.DataFrame:
    """The growth runs' rows in ``csv_path`` (none if absent); ValueError unless it is growth's CSV."""
    rows = runner.read_results(csv_path, COLUMNS, "the growth experiment")
    return rows.assign(flags=rows["flags"].astype(object).fillna("").astype(str)) if len(rows) else rows


def done_runs(csv_path: Path) -> set:
    return {(r.config, float(r.lr), int(r.seed)) for r in read_rows(csv_path).itertuples()}


def run(jobs: list[Job], data, csv_path: Path, runs: Path, eval_every: int, threads: int = 2,
        log=print, reading: list[str] = READING) -> pd.DataFrame:
    """Train each job not yet in ``csv_path``, one after the other, holding ``csv_path`` and
    ``runs``; each run's rows added whole as it ends. Returns the CSV's rows."""
    with runner.held(csv_path, runs):
        done = done_runs(csv_path)
        for job in jobs:
            if (job.config, float(job.lr), int(job.seed)) in done:
                log(f"{job.config} ({job.schedule}) lr {job.lr:g} seed {job.seed}: kept from {csv_path}")
                continue
            rows = train_path(job, data, runs, eval_every, threads, reading)
            append_csv(csv_path, rows, replace=RUN_KEY)
            log(f"{job.config} ({job.schedule}) lr {job.lr:g} seed {job.seed}: final CE {rows[-1]['val_ce']:.4f} "
                f"({rows[-1]['flops']:.3g} FLOPs, {rows[-1]['wall_s']:.0f} s)")
    return read_rows(csv_path)


def best_lr(rows: pd.DataFrame, schedule: str = SWEEP["schedule"]) -> float:
    """The sweep's rate of lowest final CE."""
    s = rows[rows["config"] == sweep_config(schedule)]
    if s.empty:
        raise ValueError(f"no sweep runs of {schedule}: run the sweep first")
    final = s.loc[s.groupby("lr")["flops"].idxmax()]
    return float(final.loc[final["val_ce"].idxmin(), "lr"])


def reach(curve: pd.DataFrame, target: float) -> float:
    """The FLOPs at which ``curve`` (rows by FLOPs) first has CE ≤ ``target``, interpolated linearly
    between its validations; NaN if it never does."""
    c = curve.sort_values("flops")
    below = np.flatnonzero(c["val_ce"].to_numpy() <= target)
    if not len(below):
        return math.nan
    i = below[0]
    if i == 0:
        return float(c["flops"].iloc[0])
    (f0, f1), (e0, e1) = c["flops"].iloc[i - 1:i + 1], c["val_ce"].iloc[i - 1:i + 1]
    return float(f0 + (f1 - f0) * (e0 - target) / (e0 - e1))


def saving(rows: pd.DataFrame, grown: str = "restart", scratch: str = "scratch") -> pd.DataFrame:
    """Per seed: the scratch path's final CE and FLOPs, whether its curve had settled (the
    convergence rule on validation CE over its last quarter: the CE the grown path must reach is
    the budget's, not a point on a curve still falling), the grown path's final CE, and the fraction
    of the scratch path's FLOPs (and training time) at which the grown path first reaches that CE
    (``grown`` and ``scratch``: the two runs' configs)."""
    out = []
    for seed, g in rows.groupby("seed"):
        gr, sc = g[g["config"] == grown], g[g["config"] == scratch]
        if gr.empty or sc.empty:
            continue
        last = sc.loc[sc["flops"].idxmax()]
        flops = reach(gr, last["val_ce"])
        wall = np.interp(flops, gr["flops"], gr["wall_s"]) if math.isfinite(flops) else math.nan
        sc = sc.sort_values("flops")
        out.append({"seed": seed, "scratch_ce": last["val_ce"], "scratch_flops": last["flops"],
                    "scratch_settled": settled(sc["flops"].tolist(), sc["val_ce"].tolist(), CE_TOL),
                    "grown_ce": gr.loc[gr["flops"].idxmax(), "val_ce"], "grown_flops_to_reach": flops,
                    "flops_ratio": flops / last["flops"], "wall_ratio": wall / last["wall_s"]})
    return pd.DataFrame(out)


def ranking(rows: pd.DataFrame, scratch: str = "scratch") -> pd.DataFrame:
    """Every grown config of ``rows`` against ``scratch`` over the seeds both have: seeds, mean
    final CE, whether scratch settled from every seed, mean fraction of the scratch path's FLOPs to
    reach its final CE (NaN where a seed never does), best first (the lowest fraction; those that
    never reach it by their final CE)."""
    out = []
    for config in rows.loc[rows["path"] == "grown", "config"].unique():
        s = saving(rows, config, scratch)
        if len(s):
            out.append({"config": config, "seeds": len(s), "grown_ce": s["grown_ce"].mean(),
                        "scratch_ce": s["scratch_ce"].mean(), "scratch_settled": bool(s["scratch_settled"].all()),
                        "flops_ratio": s["flops_ratio"].mean(skipna=False),
                        "wall_ratio": s["wall_ratio"].mean(skipna=False)})
    if not out:
        return pd.DataFrame(columns=["config", "seeds", "grown_ce", "scratch_ce", "scratch_settled", "flops_ratio",
                                     "wall_ratio"])
    return pd.DataFrame(out).sort_values(["flops_ratio", "grown_ce"], na_position="last").reset_index(drop=True)


# The jump after growth: the grown model validated before its first update and after these steps
JUMP_STEPS = (1, 10, 50, 100)
JUMP = {  # name: the grown stage's rate (× the target's), warm-up, growth operator
    "1x, warm-up 10": (1.0, 10, "interleave"), "0.5x, warm-up 10": (0.5, 10, "interleave"),
    "0.25x, warm-up 10": (0.25, 10, "interleave"), "1x, warm-up 100": (1.0, 100, "interleave"),
    "0.5x, warm-up 100": (0.5, 100, "interleave"), "stacked, 1x, warm-up 10": (1.0, 10, "stack")}
JUMP_COLUMNS = ("config", "lr", "warmup", "depth", "step", "tokens", "val_ce", "val_bpb", "seed")


def jump(data, csv_path: Path, runs: Path, lr: float, seed: int = 0, settings: dict = JUMP,
         steps: tuple = JUMP_STEPS, eval_every: int = 250, threads: int = 2, log=print,
         reading: list[str] = READING, small: str = "3M", target: str = "4M",
         presets: tuple[str, str] = (SMALL, TARGET)) -> pd.DataFrame:
    """Where the grown model loses its function: ``SMALL`` (``presets[0]``) trained for ``small`` tokens at its rate
    (a one-stage schedule validated every ``eval_every`` steps as the search's runs are, so that
    their first stage is this one: :func:`share_first_stage`), then for each of ``settings`` grown into
    ``TARGET`` (``presets[1]``) and trained as the grown path's stage would be (``target`` tokens planned, the
    setting's rate and warm-up), validated on the whole held-out split before any update and
    after each of ``steps`` (each stretch a ``--stop-after`` of the trainer, resumed exactly).
    Rows in ``csv_path`` per (setting, step); a setting whose rows are there is kept."""
    from fractus.training.command import train
    with runner.held(csv_path, runs):
        base = Job(f"{presets[0]} alone", "grown", f"{presets[0]}:{small}:lr={SMALL_LR:g}", lr, seed)
        out0 = run_dir(runs, base)
        done = set(runner.read_results(csv_path, JUMP_COLUMNS, "the growth jump")["config"])
        if set(settings) - done:  # the small model, trained (or resumed) only where a setting needs it
            train_path(base, data, runs, eval_every, threads, reading)
        ckpt = out0 / f"0-{presets[0]}" / "ckpt.pt"
        tokens = parse_schedule(f"{presets[1]}:{target}")[0].tokens  # "4M" → 4,000,000
        for name, (rate, warmup, depth) in settings.items():
            if name in done:
                log(f"jump {name}: kept from {csv_path}")
                continue
            out = Path(runs) / f"jump-{re.sub(r'[^A-Za-z0-9.]+', '_', name)}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)  # a stopped setting starts again: minutes
            argv = ["--grow-from", str(ckpt), "--grow-depth", depth, "--preset", presets[1], "--tokens", str(tokens),
                    "--data", str(data), "--out", str(out), "--lr", repr(rate * lr), "--warmup", str(warmup),
                    "--seed", str(seed), "--threads", str(threads), "--eval-every", "0", "--ckpt-every", "0",
                    "--sample-tokens", "0", "--no-progress", *reading]
            rows, at = [_jump_row(name, rate * lr, warmup, depth, seed, 0, None, ckpt, argv)], 0
            for n in steps:
                train(argv + ["--stop-after", str(n - at)] + (["--resume"] if at else []))
                at = n
                rows.append(_jump_row(name, rate * lr, warmup, depth, seed, n, out / "ckpt.pt", ckpt, argv))
            append_csv(csv_path, rows, replace=("config", "seed"))
            log(f"jump {name}: " + ", ".join(f"step {r['step']} {r['val_ce']:.4f}" for r in rows))
    return runner.read_results(csv_path, JUMP_COLUMNS, "the growth jump")


def _jump_row(name, lr, warmup, depth, seed, step, ckpt, small_ckpt, argv) -> dict:
    """The whole-split validation of the grown model at ``step`` (0: as grown, before any update)."""
    from fractus.data import load_meta, load_tokens
    from fractus.grow import grow
    from fractus.model import FractusCTE
    from fractus.tokenizer import get_tokenizer, token_byte_lengths
    from fractus.training.evaluation import evaluate_text
    from fractus.training.options import build_parser, make_config
    args = build_parser().parse_args(argv)
    meta = load_meta(args.data)
    if ckpt is None:  # as the trainer builds it: its seed, then the growth
        torch.manual_seed(args.seed)
        model = grow(small_ckpt, make_config(args, meta["vocab_size"]), args.grow_depth)
    else:
        model = FractusCTE.load(ckpt)
    val = evaluate_text(model, load_tokens(args.data, "val", meta), args.batch_size, args.chunk_len, None,
                        token_byte_lengths(get_tokenizer(meta["vocab_size"])), torch.device("cpu"))
    return {"config": name, "lr": lr, "warmup": warmup, "depth": depth, "step": step,
            "tokens": step * args.batch_size * args.chunk_len * args.accum, "val_ce": val["val_ce"],
            "val_bpb": val["val_bpb"], "seed": seed}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.experiments.growth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("sweep", "jump", "search", "seeds"))
    ap.add_argument("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    ap.add_argument("--csv", default="results/growth_cpu.csv")
    ap.add_argument("--jump-csv", default="results/growth_jump_cpu.csv")
    ap.add_argument("--runs", default="runs/growth", help="the runs' directories (kept for resuming)")
    ap.add_argument("--lr", type=float, default=None, help="the target's peak rate (default: the sweep's best)")
    ap.add_argument("--eval-every", type=int, default=250, help="optimizer steps between validations")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(BEST_SEEDS),
                    help="seeds: the best configs' (%(default)s)")
    ap.add_argument("--best", type=int, default=2, help="seeds: how many of the search's best configs")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    def body():
        csv_path, runs = Path(a.csv), Path(a.runs)
        if a.phase == "sweep":
            rows = run(sweep_jobs(SWEEP["schedule"], SWEEP["lrs"], SEEDS[0]), a.data, csv_path, runs, a.eval_every, a.threads)
            print(f"best rate: {best_lr(rows):g}")
            return
        lr = a.lr if a.lr is not None else best_lr(read_rows(csv_path))
        if a.phase == "jump":
            print(jump(a.data, Path(a.jump_csv), runs, lr, SEEDS[0], eval_every=a.eval_every, threads=a.threads).to_string())
            return
        if a.phase == "search":  # one seed: round 1, then round 2 on round 1's best
            rows, _ = search(a.data, csv_path, runs, lr, SEEDS[0], a.eval_every, a.threads)
        else:  # the search's best configs from every seed
            rows, _ = best_seeds(a.data, csv_path, runs, lr, a.seeds, a.best, a.eval_every, a.threads)
        print(ranking(rows[rows["lr"] == lr]).to_string(float_format=lambda x: f"{x:.4g}"))
    runner.main(body)


def job_of(rows: pd.DataFrame, config: str, lr: float, seed: int) -> Job:
    """The job of ``config`` as its rows record it, from ``seed``."""
    r = rows[rows["config"] == config].iloc[0]
    return Job(config, r["path"], r["schedule"], lr, seed, tuple(str(r["flags"]).split()))


if __name__ == "__main__":
    main()
