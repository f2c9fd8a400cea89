"""``python -m fractus.bench cpu`` at smoke sizes (FRACTUS_SMOKE=1): every subject writes its CSV,
every row with a positive, finite measurement and its provenance; the ops' rows in the harness's one
schema."""
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from fractus.bench.harness import COLUMNS
from util import ROOT

OPS = ("linear_attention", "delta_rule", "moe", "cross_entropy")  # their rows: the harness's (metric, median)


def test_bench_cpu_writes_every_subjects_csv(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fractus.bench", "cpu", "--out", str(tmp_path)], cwd=ROOT,
                       env=dict(os.environ, FRACTUS_SMOKE="1"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in (*OPS, "train"):
        t = pd.read_csv(tmp_path / f"{name}_cpu.csv")
        measured = t.loc[t["metric"] == "time", "median"] if name in OPS else t["tok_s"]
        assert len(measured) >= 2 and all(v > 0 and math.isfinite(v) for v in measured), (name, measured.tolist())
        assert t[["machine", "device", "torch", "git_sha", "date"]].notna().all().all(), name
        if "dtype" in t:  # torch's names, as every CSV writes them (common.dtype_name)
            assert set(t["dtype"]) <= {"float32", "float16", "bfloat16"}, (name, set(t["dtype"]))
        if name in OPS:  # one schema, the provenance after it; each op's targets judged
            assert list(t.columns[:len(COLUMNS)]) == list(COLUMNS) and (t["op"] == name).all(), name
            assert t.loc[t["target"].notna(), "target_met"].notna().all(), name
    train = pd.read_csv(tmp_path / "train_cpu.csv")  # each default case beside its original, same run
    default = train[~train["preset"].str.startswith("original-")]
    assert {f"original-{p}" for p in default["preset"]} <= set(train["preset"]), train["preset"].tolist()
    assert default["vs_original"].notna().all() and (default["vs_original"] > 0).all(), default["vs_original"]


def test_an_out_folder_that_cannot_be_written_is_refused_before_measuring(capsys, monkeypatch):
    """Checked first: nothing is measured (the measuring functions would fail the test) and the error
    names the folder."""
    from fractus.bench import __main__ as bench_main
    monkeypatch.setattr(bench_main, "run_cpu", lambda *a: (_ for _ in ()).throw(AssertionError("measured")))
    with pytest.raises(SystemExit) as e:
        bench_main.main(["cpu", "--out", "/proc/self/fractus-results"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --out /proc/self/fractus-results cannot be written"), err
