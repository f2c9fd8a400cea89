"""Progressive growth as one run (``--schedule``): stages grown into each other, one record with
tokens and FLOPs from the start, exact resume after a kill in any stage, refusals."""
import csv
import json
import signal

import pytest

from fractus.training.schedule import GROWN_WARMUP, Stage, parse_schedule
from fractus.training.loop import main, train
from test_train import popen, wait_for_rows
from util import make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEDULE = "tiny:320,tiny:640:lr=0.001"  # 10 then 20 steps of 32 tokens


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def argv(data, out, *extra, schedule=SCHEDULE):
    return ["--schedule", schedule, "--data", str(data), "--out", str(out), "--batch-size", "2", "--chunk-len", "16",
            "--accum", "1", "--threads", "1", "--eval-every", "10", "--eval-tokens", "128", "--ckpt-every", "5",
            "--sample-tokens", "0", "--no-progress", *extra]


def record(out):
    """OUT/metrics.csv without the time columns."""
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in ("tok_s", "elapsed_s")} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule") / "run"
    train(argv(data, out))
    return out, record(out)


def test_parse_schedule():
    assert parse_schedule("palier0:3M,palier1:1.5G:lr=1e-3:warmup=5") == [
        Stage("palier0", 3_000_000), Stage("palier1", 1_500_000_000, 1e-3, 5)]
    for bad in ("palier0", "palier0:x", "palier0:3M:lr=a", "palier0:3M:beta=1", ":3M", "palier0:0"):
        with pytest.raises(ValueError, match="--schedule"):
            parse_schedule(bad)


def test_one_record_across_stages(reference):
    out, rows = reference
    assert [(r["stage"], r["step"]) for r in rows] == [("0", str(s)) for s in range(1, 11)] + [
        ("1", str(s)) for s in range(1, 21)]
    tokens, flops = [int(r["tokens"]) for r in rows], [float(r["flops"]) for r in rows]
    assert tokens == [32 * i for i in range(1, 31)] and flops == sorted(flops) and flops[0] > 0
    assert rows[9]["val_ce"] and rows[-1]["val_ce"] and json.loads((out / "schedule.json").read_text())
    import torch
    ck = torch.load(out / "1-tiny" / "ckpt.pt", weights_only=True)
    assert ck["args"]["warmup"] == GROWN_WARMUP and ck["args"]["lr"] == 0.001
    assert ck["args"]["grow_from"] == str(out / "0-tiny" / "ckpt.pt")


@pytest.mark.parametrize("stage, rows", [("0-tiny", 7), ("1-tiny", 7)])
def test_kill9_in_any_stage_then_resume_equals_uninterrupted(data, reference, tmp_path, stage, rows):
    out = tmp_path / "run"
    proc = popen(argv(data, out))
    try:
        wait_for_rows(proc, out / stage, rows)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    train(argv(data, out, "--resume"))
    assert record(out) == reference[1]


def test_refusals(data, reference, tmp_path, capsys):
    out, _ = reference

    def refused(args, message):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    refused(argv(data, out), "schedule.json exists: pass --resume")
    refused(argv(data, out, "--resume", schedule="tiny:320,tiny:960"), "--resume with another schedule")
    refused(argv(data, tmp_path / "a", schedule="palier1:320,palier0:320"), "cannot grow into stage 1")
    refused(argv(data, tmp_path / "b", "--model", "transformer"), "growth is not defined for --model transformer")
