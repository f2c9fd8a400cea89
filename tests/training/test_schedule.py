"""Progressive growth as one run (``--schedule``): stages grown into each other, one record with
tokens and FLOPs from the start, exact resume after a kill in any stage, refusals."""
import csv
import json
import signal
import subprocess

import pytest

from fractus.training.command import main, train
from fractus.training.schedule import GROWN_WARMUP, Stage, parse_schedule
from util import make_corpus, popen, wait_for_rows

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEDULE = "tiny:320,tiny:640:lr=0.001"  # 10 then 20 steps of 32 tokens
# one warmup-stable-decay curve over both stages, the second grown by stacking the trained blocks
ONE_CURVE = ("tiny:320,tiny:640:depth=stack", "--stage-lr", "continue", "--lr-shape", "wsd")


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
    assert parse_schedule("palier0:3M,palier1:1.5G:lr=1e-3:warmup=5:depth=stack") == [
        Stage("palier0", 3_000_000), Stage("palier1", 1_500_000_000, 1e-3, 5, "stack")]
    for bad in ("palier0", "palier0:x", "palier0:3M:lr=a", "palier0:3M:beta=1", ":3M", "palier0:0", "",
                "palier0:3M:lr=nan", "palier0:3M:lr=inf", "palier0:3M:lr=1e39", "palier0:3M:lr=-1",
                "palier0:3M:warmup=-1", "palier0:3M:lr=1e-3:lr=2e-3", "palier0:3M,palier1:3M:depth=copy",
                "palier0:3M:depth=stack,palier1:3M"):
        with pytest.raises(ValueError, match="--schedule"):
            parse_schedule(bad)
    with pytest.raises(ValueError, match="gives lr twice"):
        parse_schedule("palier0:3M:lr=1e-3:lr=2e-3")


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


@pytest.fixture(scope="module")
def one_curve(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule") / "run"
    train(argv(data, out, *ONE_CURVE[1:], schedule=ONE_CURVE[0]))
    return out, record(out)


def test_stages_on_one_curve(one_curve):
    """``--stage-lr continue --lr-shape wsd``: 30 steps on one curve, its decay over the last 6
    (the first stage's warm-up: 5 % of 10 steps, none): the first stage ends at the peak, the
    second ramps up to it over its 10 warm-up steps, holds it and ends at the floor."""
    _, rows = one_curve
    lr = [float(r["lr"]) for r in rows]
    peak = 6e-3
    # a row holds the rate after its step: the next step's (stage 1's step k: (k + 1) / 10 of the curve)
    assert lr[:10] == [peak] * 10 and lr[18:24] == [peak] * 6
    assert lr[10:18] == pytest.approx([peak * (k + 1) / 10 for k in range(1, 9)])
    assert lr[-1] == pytest.approx(0.1 * peak) and lr[24] < peak


@pytest.mark.parametrize("stage, rows, options", [("0-tiny", 7, ()), ("1-tiny", 7, ()), ("1-tiny", 7, ONE_CURVE)])
def test_kill9_in_any_stage_then_resume_equals_uninterrupted(data, request, tmp_path, stage, rows, options):
    expected = request.getfixturevalue("one_curve" if options else "reference")[1]
    extra = dict(schedule=options[0]) if options else {}
    out = tmp_path / "run"
    proc = popen(argv(data, out, *options[1:], **extra))
    try:
        wait_for_rows(proc, out / stage, rows)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    train(argv(data, out, "--resume", *options[1:], **extra))
    assert record(out) == expected


def test_ctrl_c_stops_a_schedule_with_exit_code_130(data, tmp_path):
    """``python -m fractus.train --schedule …`` and Ctrl-C: the stage saves, and the command exits
    with 130 without a traceback, as a single run does (one Interrupted class, whichever module
    runs as __main__)."""
    out = tmp_path / "run"
    proc = popen(argv(data, out))
    try:
        wait_for_rows(proc, out / "0-tiny", 3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert "checkpoint saved" in stdout and (out / "0-tiny" / "ckpt.pt").exists()


def test_refusals(data, reference, tmp_path, capsys):
    out, _ = reference

    def refused(args, message):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    refused(argv(data, out), "schedule.json exists: pass --resume")
    refused(argv(data, out, "--resume", schedule="tiny:320,tiny:960"), "--resume with another schedule")
    refused(argv(data, out, "--resume", "--stage-lr", "continue"), "--resume with another schedule")
    refused(argv(data, out, "--resume", schedule="tiny:320,tiny:640:lr=0.001:depth=stack"),
            "--resume with another schedule")
    refused(argv(data, tmp_path / "a", schedule="palier1:320,palier0:320"), "cannot grow into stage 1")
    refused(argv(data, tmp_path / "b", "--model", "transformer"), "growth is not defined for --model transformer")
    single = argv(data, tmp_path / "c", "--stage-lr", "continue")[2:]  # no --schedule
    refused(single + ["--tokens", "320"], "--stage-lr sets how a --schedule's stages share the rate")
    assert not (tmp_path / "c").exists()


def test_bad_stage_options_are_refused_before_anything_is_written(data, tmp_path, capsys):
    for schedule in ("tiny:320:lr=nan", "tiny:320:lr=1e39", "", "tiny:320:lr=1e-3:lr=2e-3"):
        with pytest.raises(SystemExit) as e:
            main(argv(data, tmp_path / "out", schedule=schedule))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: --schedule") and err.count("\n") == 1, err
        assert not (tmp_path / "out" / "schedule.json").exists()


def test_a_stage_killed_before_its_first_checkpoint_starts_again(data, reference, tmp_path):
    """A stage stopped before it saved (kill -9, a full disk) leaves its metrics.csv and no
    checkpoint — made here from the finished run: --resume starts that stage afresh instead of
    refusing it for ever, and the schedule ends as the uninterrupted one."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    (out / "1-tiny" / "ckpt.pt").unlink()
    with open(out / "1-tiny" / "metrics.csv") as f:
        head = f.readlines()[:4]
    (out / "1-tiny" / "metrics.csv").write_text("".join(head))
    train(argv(data, out, "--resume"))
    assert record(out) == reference[1]


def test_a_damaged_record_is_named_or_remade(data, reference, tmp_path, capsys):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    (out / "metrics.csv").write_text("garbled,,\n1,2\n")  # the record is remade from the stages' own
    main(argv(data, out, "--resume"))
    assert record(out) == reference[1]
    for damage in ("{}", "[]", "not json", '{"schedule": 3}'):
        (out / "schedule.json").write_text(damage)
        with pytest.raises(SystemExit) as e:
            main(argv(data, out, "--resume"))
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{out / 'schedule.json'} is damaged" in err, err
