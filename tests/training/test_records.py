"""Provenance and the results CSVs (:mod:`fractus.training.records`)."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from fractus.training import records


def test_git_sha_is_dirty_for_code_not_for_results(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    def notebook(code, output):
        cell = {"cell_type": "code", "source": [code], "outputs": [{"output_type": "stream", "text": [output]}]}
        (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell], "metadata": {}}))
    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.csv").write_text("a\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    notebook("print(1)", "1")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = records.git_sha(tmp_path)
    assert len(clean) == 12 and not clean.endswith("-dirty")
    (tmp_path / "results" / "x.csv").write_text("b\n")  # a run writing its outputs
    notebook("print(1)", "2")                            # a notebook run in place: new outputs
    assert records.git_sha(tmp_path) == clean
    notebook("print(2)", "2")                            # its code changed
    assert records.git_sha(tmp_path) == clean + "-dirty"
    notebook("print(1)", "2")
    assert records.git_sha(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert records.git_sha(tmp_path) == clean + "-dirty"


def test_provenance_reads_the_gpu_name_once(monkeypatch):
    """Rows written after a kernel lost CUDA's context (every CUDA call then fails) keep the name."""
    names = iter(["NVIDIA H200"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: next(names))  # a second call raises
    records.cuda_name.cache_clear()
    try:
        assert records.provenance("cuda")["device"] == records.provenance("cuda")["device"] == "NVIDIA H200"
    finally:
        records.cuda_name.cache_clear()


def test_append_csv_keeps_its_rows_and_refuses_other_files(tmp_path):
    """A row is added to a CSV of the same columns (absent or empty: created); any other file is left
    byte for byte as it was, with a ValueError naming it."""
    table = tmp_path / "eval.csv"
    table.write_text("")
    for ce in (1.5, 2.5):
        records.append_csv(table, {"checkpoint": "a.pt", "ce": ce})
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["ce"] for r in rows] == ["1.5", "2.5"] and all(r["git_sha"] for r in rows)
    records.append_csv(table, {"checkpoint": "b.pt", "ce": 3.5, "device": "cpu: a worker (1 threads)"})
    with open(table, newline="") as f:  # a row made elsewhere keeps the provenance it names
        last = list(csv.DictReader(f))[-1]
    assert last["device"] == "cpu: a worker (1 threads)" and last["git_sha"] == rows[0]["git_sha"]
    foreign = {"metrics.csv": b"step,tokens,val_ce\r\n1,128,\r\n2,256,6.1\r\n", "notes.txt": b"not a table\n",
               "other.csv": b"checkpoint,ce\n", "binary.csv": bytes(range(256)),
               "ragged.csv": table.read_bytes() + b"b.pt,3.5\r\n"}
    for name, content in foreign.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"{name} is not a CSV"):
            records.append_csv(tmp_path / name, {"checkpoint": "a.pt", "ce": 1.5})
        assert (tmp_path / name).read_bytes() == content
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="its folder cannot be created or written"):
        records.append_csv(tmp_path / "file" / "eval.csv", {"ce": 1.5})


def test_write_csv_appends_the_provenance_to_every_row(tmp_path):
    path = records.write_csv(tmp_path / "sub" / "t.csv", [{"a": 1}, {"a": 2, "b": 3}])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"]) for r in rows] == [("1", ""), ("2", "3")]
    assert set(records.provenance()) < set(rows[0]) and all(r["torch"] == torch.__version__ for r in rows)
    with pytest.raises(ValueError, match="no rows"):
        records.write_csv(tmp_path / "empty.csv", [])
    assert not (tmp_path / "empty.csv").exists()


def test_evaluation_and_training_do_not_import_the_benchmarks():
    """Provenance lives beside the model: ``fractus.evaluate`` and the trainer's command
    (``fractus.training.command``, all that ``fractus.train`` imports) load no ``fractus.bench`` module."""
    code = ("import sys, fractus.evaluate, fractus.training.command; "
            "print(sorted(m for m in sys.modules if m.startswith('fractus.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
