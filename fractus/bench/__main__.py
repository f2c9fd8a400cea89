"""``python -m fractus.bench cpu --out results`` · ``python -m fractus.bench gpu --out results/gpu``.

``cpu`` measures training throughput and each op's PyTorch path against its baseline and
writes ``results/*_cpu.csv``. ``gpu`` is the GPU suite (:mod:`fractus.bench.gpu`);
``--dry-run`` runs its code paths on CPU at tiny sizes.
"""
from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import pandas as pd

from fractus.allocator import keep_freed_memory
from fractus.bench.common import SMOKE, write_csv

SUBJECTS = ("train", "linear_attention", "moe", "cross_entropy")


def run_cpu(out: Path, smoke: bool, only: list[str]) -> None:
    for name in only:
        mod = importlib.import_module(f"fractus.bench.{name}")
        rows = mod.cpu_rows(smoke=smoke)
        path = write_csv(out / f"{name}_cpu.csv", rows)
        print(f"\n== {name} → {path}")
        print(pd.DataFrame(rows).drop(columns=[], errors="ignore").to_string(index=False, max_colwidth=28))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fractus.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="CPU benchmarks → OUT/*_cpu.csv")
    c.add_argument("--out", default="results")
    c.add_argument("--smoke", action="store_true", default=SMOKE, help="tiny sizes (FRACTUS_SMOKE=1)")
    c.add_argument("--only", nargs="*", default=list(SUBJECTS), choices=SUBJECTS)
    g = sub.add_parser("gpu", help="the GPU suite → OUT/*.csv")
    g.add_argument("--out", default="results/gpu")
    g.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
    a = ap.parse_args(argv)
    keep_freed_memory()
    if a.cmd == "cpu":
        run_cpu(Path(a.out), a.smoke, a.only)
    else:
        if a.dry_run:  # the kernels run in Triton's interpreter; set before triton is imported
            os.environ["TRITON_INTERPRET"] = "1"
        from fractus.bench.gpu import run_suite
        run_suite(Path(a.out), dry_run=a.dry_run)


if __name__ == "__main__":
    main()
