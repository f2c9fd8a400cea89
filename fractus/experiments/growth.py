"""What progressive growth buys: a grown model against the same preset trained from scratch.

Two paths, each one ``--schedule`` run of the trainer (:mod:`fractus.training.schedule`) on the same
prepared tokens, read and scored the same way:

- ``grown``: the small preset, then grown (same logits) into the target and trained on;
- ``scratch``: the target preset from a fresh initialisation.

Both validate on the whole held-out split every ``eval_every`` steps, so that each path is a curve
of validation CE against cumulative training FLOPs (6 · active parameters per token, summed over
the stages) and training time. :func:`saving` reads the curves: the FLOPs at which the grown path
first reaches the scratch path's final CE, as a fraction of the scratch path's FLOPs (below 1:
growth saves compute; NaN: the grown path never gets there).

``python -m fractus.experiments.growth sweep|measure --data DIR``: ``sweep`` trains the target from scratch
at each of a few peak rates on a short budget (its tuned rate), ``measure`` trains both paths from
each seed. Every run resumes in its directory under ``--runs``; every finished run's evaluations
are rows of ``--csv`` (``results/growth_cpu.csv``) with provenance, written whole, and a run whose
rows are there is not trained again (:mod:`.runner`). A row's ``lr`` is the run's ``--lr``, the target's rate; a stage whose
schedule names its own rate (the grown path's small stage: ``lr=…`` in ``schedule``) trains at that.
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import pandas as pd

from fractus.experiments import runner
from fractus.training.records import append_csv
from fractus.training.optim import default_lr

SMALL, TARGET = "palier0", "palier1"
# the small stage at its own tuned rate; the target's stages at the rate the run is given
PATHS = {"grown": f"{SMALL}:3M:lr={default_lr('adamw', 'cte', SMALL):g},{TARGET}:4M", "scratch": f"{TARGET}:6M"}
SWEEP = {"schedule": f"{TARGET}:1.5M", "lrs": (1.5e-3, 3e-3, 6e-3)}
SEEDS = (0, 1)
READING = ["--batch-size", "32", "--chunk-len", "64", "--accum", "1"]  # 2,048 tokens a step: 32 windows of 64
COLUMNS = ("path", "schedule", "stage", "preset", "tokens", "flops", "lr", "seed", "val_ce", "val_bpb", "wall_s")


def run_dir(runs: Path, path: str, schedule: str, lr: float, seed: int) -> Path:
    return Path(runs) / f"{path}-{schedule.replace(':', '_').replace(',', '+')}-lr{lr:g}-seed{seed}"


def train_path(path: str, schedule: str, data, runs: Path, lr: float, seed: int, eval_every: int,
               threads: int = 2, reading: list[str] = READING) -> list[dict]:
    """Train ``schedule`` (resuming its directory if it was stopped) at peak rate ``lr`` (every stage
    that names none) from ``seed``; one row per validation, CE on the whole held-out split."""
    from fractus.training.command import train
    out = run_dir(runs, path, schedule, lr, seed)
    argv = ["--schedule", schedule, "--data", str(data), "--out", str(out), "--lr", repr(lr), "--seed", str(seed),
            "--threads", str(threads), "--eval-every", str(eval_every), "--eval-tokens", str(10 ** 12),
            "--sample-tokens", "0", "--no-progress", *reading]
    train(argv + (["--resume"] if (out / "schedule.json").exists() else []))
    return curve(out / "metrics.csv", path, schedule, lr, seed)


def curve(record: Path, path: str, schedule: str, lr: float, seed: int) -> list[dict]:
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
            out.append({"path": path, "schedule": schedule, "stage": int(r["stage"]), "preset": r["preset"],
                        "tokens": int(r["tokens"]), "flops": float(r["flops"]), "lr": lr, "seed": seed,
                        "val_ce": float(r["val_ce"]), "val_bpb": float(r["val_bpb"]),
                        "wall_s": before + stage_end})
    return out


RUN_KEY = ("path", "schedule", "lr", "seed")  # a run's rows in the CSV


def read_rows(csv_path) -> pd.DataFrame:
    """The growth runs' rows in ``csv_path`` (none if absent); ValueError unless it is growth's CSV."""
    return runner.read_results(csv_path, COLUMNS, "the growth experiment")


def done_runs(csv_path: Path) -> set:
    return {(r.path, r.schedule, float(r.lr), int(r.seed)) for r in read_rows(csv_path).itertuples()}


def run(jobs: list[tuple], data, csv_path: Path, runs: Path, eval_every: int, threads: int = 2,
        log=print, reading: list[str] = READING) -> pd.DataFrame:
    """Train each (path, schedule, lr, seed) of ``jobs`` not yet in ``csv_path``, one after the
    other, holding ``csv_path`` and ``runs``; each run's rows added whole as it ends. Returns the
    CSV's rows."""
    with runner.held(csv_path, runs):
        done = done_runs(csv_path)
        for path, schedule, lr, seed in jobs:
            if (path, schedule, float(lr), int(seed)) in done:
                log(f"{path} {schedule} lr {lr:g} seed {seed}: kept from {csv_path}")
                continue
            rows = train_path(path, schedule, data, runs, lr, seed, eval_every, threads, reading)
            append_csv(csv_path, rows, replace=RUN_KEY)
            log(f"{path} {schedule} lr {lr:g} seed {seed}: final CE {rows[-1]['val_ce']:.4f} "
                f"({rows[-1]['flops']:.3g} FLOPs, {rows[-1]['wall_s']:.0f} s)")
    return read_rows(csv_path)


def best_lr(rows: pd.DataFrame, schedule: str = SWEEP["schedule"]) -> float:
    """The sweep's rate of lowest final CE."""
    s = rows[(rows["path"] == "scratch") & (rows["schedule"] == schedule)]
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


def saving(rows: pd.DataFrame, grown: str = PATHS["grown"], scratch: str = PATHS["scratch"]) -> pd.DataFrame:
    """Per seed: the scratch path's final CE and FLOPs, the grown path's final CE, and the fraction of
    the scratch path's FLOPs (and training time) at which the grown path first reaches that CE."""
    out = []
    for seed, g in rows.groupby("seed"):
        gr, sc = g[g["schedule"] == grown], g[g["schedule"] == scratch]
        if gr.empty or sc.empty:
            continue
        last = sc.loc[sc["flops"].idxmax()]
        flops = reach(gr, last["val_ce"])
        wall = np.interp(flops, gr["flops"], gr["wall_s"]) if math.isfinite(flops) else math.nan
        out.append({"seed": seed, "scratch_ce": last["val_ce"], "scratch_flops": last["flops"],
                    "grown_ce": gr.loc[gr["flops"].idxmax(), "val_ce"], "grown_flops_to_reach": flops,
                    "flops_ratio": flops / last["flops"], "wall_ratio": wall / last["wall_s"]})
    return pd.DataFrame(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.experiments.growth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("sweep", "measure"))
    ap.add_argument("--data", required=True, help="directory written by `python -m fractus.data prepare`")
    ap.add_argument("--csv", default="results/growth_cpu.csv")
    ap.add_argument("--runs", default="runs/growth", help="the runs' directories (kept for resuming)")
    ap.add_argument("--lr", type=float, default=None, help="measure: the peak rate (default: the sweep's best)")
    ap.add_argument("--eval-every", type=int, default=250, help="optimizer steps between validations")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                    help="measure: the seeds (default: %(default)s; one process per seed runs them side by side)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    def body():
        if a.stage == "sweep":
            jobs = [("scratch", SWEEP["schedule"], lr, SEEDS[0]) for lr in SWEEP["lrs"]]
            rows = run(jobs, a.data, Path(a.csv), Path(a.runs), a.eval_every, a.threads)
            print(f"best rate: {best_lr(rows):g}")
            return
        lr = a.lr if a.lr is not None else best_lr(read_rows(a.csv))
        jobs = [(p, PATHS[p], lr, s) for s in a.seeds for p in PATHS]
        rows = run(jobs, a.data, Path(a.csv), Path(a.runs), a.eval_every, a.threads)
        print(saving(rows[rows["lr"] == lr]).to_string(float_format=lambda x: f"{x:.4g}"))
    runner.main(body)


if __name__ == "__main__":
    main()
