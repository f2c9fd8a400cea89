"""``python -m fractus.bench cpu`` at smoke sizes (FRACTUS_SMOKE=1): every subject writes its CSV,
every row with a positive, finite measurement and its provenance."""
import math
import os
import subprocess
import sys

import pandas as pd

from util import ROOT

MEASURED = {"linear_attention": "time_s", "moe": "time_s", "cross_entropy": "time_s", "train": "tok_s"}


def test_bench_cpu_writes_every_subjects_csv(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fractus.bench", "cpu", "--out", str(tmp_path)], cwd=ROOT,
                       env=dict(os.environ, FRACTUS_SMOKE="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, col in MEASURED.items():
        t = pd.read_csv(tmp_path / f"{name}_cpu.csv")
        assert len(t) >= 2 and all(v > 0 and math.isfinite(v) for v in t[col]), (name, t[col].tolist())
        assert t[["machine", "device", "torch", "git_sha", "date"]].notna().all().all(), name
        if "dtype" in t:  # torch's names, as every CSV writes them (common.dtype_name)
            assert set(t["dtype"]) <= {"float32", "float16", "bfloat16"}, (name, set(t["dtype"]))
    train = pd.read_csv(tmp_path / "train_cpu.csv")  # each default case beside its original, same run
    default = train[~train["preset"].str.startswith("original-")]
    assert {f"original-{p}" for p in default["preset"]} <= set(train["preset"]), train["preset"].tolist()
    assert default["vs_original"].notna().all() and (default["vs_original"] > 0).all(), default["vs_original"]
