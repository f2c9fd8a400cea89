"""``python -m fractus.bench cpu|costmodel|decode|aot|gpu``.

``cpu`` measures training throughput and each op's PyTorch path against its baseline and
writes ``results/*_cpu.csv`` (tiny sizes under FRACTUS_SMOKE=1). ``costmodel`` fits this CPU's
cost model on micro-benchmarks, checks it against measured training steps
(:mod:`fractus.bench.cpu_costmodel`) and writes the same model's H200 column
(:func:`fractus.bench.costmodel.h200_rows`): ``results/costmodel_{cpu_fit,cpu_check,h200}.csv``
(tiny sizes under FRACTUS_SMOKE=1). ``decode`` times a token's decode by context position and a
prompt's prefill, the CTE against the Transformer++'s KV caches (:mod:`fractus.bench.decode`:
``results/decode_cpu.csv``, ``decode.png``). ``aot`` compiles every Triton kernel for sm_90 (H100/H200)
without a GPU and writes ``results/aot_sm90.csv`` (:mod:`fractus.verify.aot`). ``gpu`` is the GPU
suite (:mod:`fractus.bench.gpu`); ``--dry-run`` runs its code paths on CPU at tiny sizes.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd

from fractus.allocator import keep_freed_memory
from fractus.bench.common import SMOKE
from fractus.cli import run_command
from fractus.training.records import write_csv
from fractus.verify import aot

# subject (its CSV: OUT/<subject>_cpu.csv) → the module whose cpu_rows measure it
SUBJECTS = {"train": "throughput", "linear_attention": "linear_attention", "delta_rule": "delta_rule", "moe": "moe",
            "cross_entropy": "cross_entropy"}


def run_cpu(out: Path, only: list[str]) -> None:
    """Each subject's CPU rows → ``out/<subject>_cpu.csv`` (tiny sizes under FRACTUS_SMOKE=1)."""
    for name in only:
        mod = importlib.import_module(f"fractus.bench.{SUBJECTS[name]}")
        rows = mod.cpu_rows(smoke=SMOKE)
        path = write_csv(out / f"{name}_cpu.csv", rows)
        print(f"\n== {name} → {path}")
        print(pd.DataFrame(rows).to_string(index=False, max_colwidth=28))


def run_costmodel(out: Path) -> None:
    """This CPU's cost model, fitted and checked (:func:`fractus.bench.cpu_costmodel.run`), and its
    H200 column at the host's per-op cost measured here → ``out/costmodel_{cpu_fit,cpu_check,h200}.csv``."""
    from fractus.bench import costmodel, cpu_costmodel
    from fractus.bench.gpu import TRAIN_SWEEP, train_setup
    fitted, checked = cpu_costmodel.run(out, smoke=SMOKE)
    print("\n== this CPU: predicted vs measured step time → "
          f"{out / 'costmodel_cpu_fit.csv'}, {out / 'costmodel_cpu_check.csv'}")
    print(pd.DataFrame(checked)[["preset", "batch_size", "predicted_step_s", "measured_step_s", "measured_low_s",
                                 "measured_high_s", "error", "within_15pct"]].to_string(index=False))
    host_op_s = statistics.median(r["host_op_us"] for r in fitted) / 1e6
    rows = costmodel.h200_rows(TRAIN_SWEEP, train_setup, host_op_s)
    path = write_csv(out / "costmodel_h200.csv", rows)
    print(f"\n== the H200 column (host {1e6 * host_op_s:.1f} µs per op) → {path}")
    print(pd.DataFrame(rows).drop(columns=["launches", "host_op_us"]).to_string(index=False))


def run_aot(out: Path, arch: int, quick: bool, presets: list[str], workers: int = 1) -> int:
    """Compile every kernel (and each preset's training and decode launches) for sm_``arch`` in
    a fresh Triton cache (cold compile times; with ``workers`` > 1, compiled in that many
    processes first, and the table's times are cache loads); returns 1 if one failed to compile
    or needs more shared memory than a block may have."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        if workers > 1:  # a failed compile shows again below, where the same launch compiles in this process
            for w in aot.precompile(workers, presets=presets, arch=arch, timeout_s=24 * 3600, all_configs=not quick,
                                     dtypes=aot.TABLE_DTYPES):
                if w["errors"]:  # a worker that died: the rest of its share compiles below (cold, in compile_s)
                    print(f"precompile worker {w['worker']}: {w['errors']}", flush=True)
        rows = aot.compile_rows(arch, all_configs=not quick, presets=presets)
    path = write_csv(out / f"aot_sm{arch}.csv", rows)
    t = pd.DataFrame(rows)
    bad = t[~t["compiled"] | ~t["fits_shared"].fillna(False).astype(bool)]
    print(f"\n== {len(t)} kernels compiled for sm_{arch} in {t['compile_s'].sum():.0f} s → {path}")
    print(t.groupby(["op", "kernel", "dtype"]).agg(configs=("num_warps", "size"),
                                                   spill_min=("spill_store_bytes", "min"),
                                                   spill_max=("spill_store_bytes", "max"),
                                                   smem_max=("shared_bytes", "max"),
                                                   compile_s=("compile_s", "sum")).to_string())
    print(f"failed or over the shared-memory limit: {len(bad)}")
    return 1 if len(bad) else 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="CPU benchmarks → OUT/*_cpu.csv")
    c.add_argument("--out", default="results")
    c.add_argument("--only", nargs="*", default=list(SUBJECTS), choices=SUBJECTS)
    m = sub.add_parser("costmodel", help="this CPU's cost model, fitted and checked, and its H200 column "
                                         "→ OUT/costmodel_{cpu_fit,cpu_check,h200}.csv")
    m.add_argument("--out", default="results")
    d = sub.add_parser("decode", help="decode and prefill, CTE against Transformer++ → OUT/decode_cpu.csv")
    d.add_argument("--out", default="results")
    t = sub.add_parser("aot", help="compile every Triton kernel for an NVIDIA target, no GPU → OUT/aot_smARCH.csv")
    t.add_argument("--out", default="results")
    t.add_argument("--arch", type=int, default=90, choices=sorted(aot.SHARED_LIMIT))
    t.add_argument("--quick", action="store_true", help="the first autotune config of each kernel only")
    t.add_argument("--presets", nargs="*", choices=aot.PRESETS, default=None,
                   help="models whose training and decode launches to compile too (default: all; none with --quick)")
    t.add_argument("--workers", type=int, default=1,
                   help="compile in this many processes first (the table's compile_s then times cache loads)")
    g = sub.add_parser("gpu", help="the GPU suite → OUT/*.csv")
    g.add_argument("--out", default="results/gpu")
    g.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
    g.add_argument("--time-limit-s", type=float, default=None,
                   help="start no part after this many seconds (skipped parts go to failures.csv)")
    # how the suite runs its remaining parts in a fresh process after CUDA's context is lost
    g.add_argument("--resume-parts", nargs="+", default=None, help=argparse.SUPPRESS)
    g.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    keep_freed_memory()
    if Path(a.out).exists() and not Path(a.out).is_dir():  # before any measurement, not after
        ap.error(f"--out {a.out} is a file: give the folder its CSVs go to")
    run_command(lambda: run(ap, a), interrupted="interrupted: the CSVs written so far are whole")


def check_writable(out: Path) -> None:
    """OSError naming ``out`` unless a file can be written in it (made if absent): checked before
    anything is measured, so that no measurement is lost at the end."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        raise OSError(f"--out {out} cannot be written ({e.strerror or e}): give a folder the CSVs can go to") from None


def run(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The parsed command ``a``."""
    check_writable(Path(a.out))
    if a.cmd == "cpu":
        run_cpu(Path(a.out), a.only)
    elif a.cmd == "costmodel":
        run_costmodel(Path(a.out))
    elif a.cmd == "decode":
        from fractus.bench import decode
        rows = decode.run(Path(a.out), smoke=SMOKE)
        print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    elif a.cmd == "aot":
        try:
            aot.check_environment()
        except RuntimeError as e:
            ap.error(str(e))
        presets = a.presets if a.presets is not None else ([] if a.quick else list(aot.PRESETS))
        if a.workers < 1:
            ap.error(f"--workers must be at least 1, got {a.workers}")
        sys.exit(run_aot(Path(a.out), a.arch, a.quick, presets, a.workers))
    else:
        if a.dry_run:  # the kernels run in Triton's interpreter; set before triton is imported
            os.environ["TRITON_INTERPRET"] = "1"
        from fractus.bench.gpu import resume_parts, run_suite
        if a.resume_parts:
            if a.started_at is None:
                ap.error("--resume-parts needs --started-at")
            resume_parts(Path(a.out), a.resume_parts, a.dry_run, a.started_at, a.time_limit_s)
        else:
            run_suite(Path(a.out), dry_run=a.dry_run, time_limit_s=a.time_limit_s)


if __name__ == "__main__":
    main()
