"""The trainer's command line (``python -m fractus.train``, :mod:`fractus.training.command`): bad
corpora, arguments, token ids and run directories are one ``error:`` line with exit code 2 and
write nothing; and the commands that read its runs (evaluate, records, sample) agree with it."""
import csv
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import fractus.training.loop as loop
from fractus.checkpoint import load_checkpoint, save_checkpoint, weights_fingerprint
from fractus.data import TokenStreams, load_tokens, prepare, write_toy_corpus
from fractus.data import main as data_main
from fractus.evaluate import main as evaluate_main
from fractus.model import FractusCTE
from fractus.tokenizer import get_tokenizer
from fractus.training import records
from fractus.training.command import main, train
from fractus.training.options import build_parser
from fractus.training.runs import METRIC_FIELDS
from util import SAME, cli, make_corpus, metrics


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_bad_corpora(tmp_path, data, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    for name in ("empty.txt", "blank.txt"):
        with pytest.raises(ValueError, match="the corpus is empty"):
            prepare(str(tmp_path / name), tmp_path / "d", vocab_size=512)
    (tmp_path / "short.txt").write_text("The cat sat on the mat.\nThe dog ran.\n")
    prepare(str(tmp_path / "short.txt"), tmp_path / "short", vocab_size=512)
    with pytest.raises(ValueError, match="corpus too short"):
        TokenStreams(load_tokens(tmp_path / "short", "train"), 2, 16)
    bad = {"short": "corpus too short", "missing": "not found: run `python -m fractus.data prepare"}
    for d, msg in bad.items():
        with pytest.raises(SystemExit) as e:
            main(cli(tmp_path / d, tmp_path / f"run-{d}"))
        assert e.value.code == 2 and msg in capsys.readouterr().err
    for extra, msg in ((["--input", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "d")], "the corpus is empty"),
                       (["--input", "shakespeare", "--out", str(tmp_path / "empty.txt")], "is a file, not a directory"),
                       (["--input", str(tmp_path / "short.txt"), "--out", str(tmp_path / "d"), "--val-fraction", "1.5"],
                        "val_fraction must lie in (0, 1), got 1.5")):
        with pytest.raises(SystemExit) as e:
            data_main(["prepare", *extra])
        assert e.value.code == 2 and msg in capsys.readouterr().err


RATE = "must be finite and ≥ 0 and ≤ 1e+06"


def test_bad_arguments(data, tmp_path, capsys):
    cases = [(["--set", "n_layer=4"], "unknown config keys ['n_layer']"),
             (["--batch-size", "0"], "argument --batch-size: must be ≥ 1, got 0"),
             (["--chunk-len", "0"], "argument --chunk-len: must be ≥ 1, got 0"),
             (["--accum", "-1"], "argument --accum: must be ≥ 1, got -1"),
             (["--set", "chunk_len=64", "backend=torch"], "not --set: chunk_len → --chunk-len, backend → --backend"),
             (["--set", "n_layers=0", "tie_head=maybe"], "n_layers must be an integer ≥ 1, got 0; tie_head must be"),
             (["--set", "n_layers=3", "--set", "n_layers=4"], "--set n_layers given twice"),
             (["--set", "n_layers"], "--set expects KEY=VALUE, got 'n_layers'"),
             (["--active-blocks", "3"], "--active-blocks must be ≤ n_layers"),
             (["--lr", "inf"], f"argument --lr: {RATE}, got inf"),
             (["--optimizer", "sgd", "--lr", "1e39"], f"argument --lr: {RATE}, got 1e39"),  # not torch's overflow
             (["--optimizer", "rmsprop", "--lr", "1e300"], f"argument --lr: {RATE}, got 1e300"),
             (["--weight-decay", "1e39"], f"argument --weight-decay: {RATE}, got 1e39"),
             (["--min-lr-ratio", "5"], "argument --min-lr-ratio: must be finite and ≥ 0 and ≤ 1, got 5"),
             (["--ckpt-every", "-1"], "argument --ckpt-every: must be ≥ 0, got -1"),
             (["--threads", "-1"], "argument --threads: must be ≥ 0, got -1"),
             (["--device", "bogus"], "argument --device: not a device: 'bogus'")]
    for extra, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(cli(data, tmp_path / "run", *extra))
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    (tmp_path / "file").write_text("keep")
    with pytest.raises(SystemExit) as e:
        main(cli(data, tmp_path / "file"))
    assert e.value.code == 2 and "file is a file: give a run directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "keep"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "rmsprop"])
def test_the_largest_rates_overflow_no_optimizer(data, tmp_path, capsys, optimizer):
    """--lr and --weight-decay at their bound: the weights or the loss may overflow (a clear error),
    but no factor the optimizer derives from them does (torch's "cannot be converted to type float")."""
    try:
        main(cli(data, tmp_path / "run", "--optimizer", optimizer, "--lr", "1e6", "--weight-decay", "1e6",
                 "--warmup", "0", "--eval-every", "0", "--max-nan", "1", tokens=2 * 32))
    except SystemExit as e:
        assert e.code == 2 and "non-finite" in capsys.readouterr().err


def test_repeated_set_flags_add_up():
    args = build_parser().parse_args(["--data", "d", "--out", "o", "--set", "n_layers=3",
                                                "--set", "d_model=64", "top_k=1"])
    assert args.set == ["n_layers=3", "d_model=64", "top_k=1"]


def test_a_fresh_run_refuses_a_leftover_metrics_file(data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.csv").write_text("step,train_ce\n1,5.0\n")
    with pytest.raises(SystemExit) as e:
        main(cli(data, out, tokens=2 * 32))
    assert e.value.code == 2 and "metrics.csv exists" in capsys.readouterr().err
    assert (out / "metrics.csv").read_text() == "step,train_ce\n1,5.0\n" and not (out / "ckpt.pt").exists()


def test_bad_token_ids_and_vocab(tmp_path, data, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("meta.json", "val.bin", "train.bin"):
        (bad / f).write_bytes((data / f).read_bytes())
    ids = np.memmap(bad / "train.bin", dtype=np.uint16, mode="r+")
    ids[len(ids) - 9] = 600  # near the end: found before training, not when a batch reaches it
    ids.flush()
    del ids
    meta = json.loads((data / "meta.json").read_text())
    edited, renamed = tmp_path / "edited", tmp_path / "renamed"  # vocab_size 512 → 600 in meta.json
    for d, m in ((edited, {**meta, "vocab_size": 600}),
                 (renamed, {**meta, "vocab_size": 600, "encoding": "cl100k_600"})):
        shutil.copytree(data, d)
        (d / "meta.json").write_text(json.dumps(m))
    cases = [(bad, [], "train.bin holds token ids ≥ vocab_size 512 (1 of them, the first 600 at position"),
             (data, ["--set", "vocab_size=256"], "differs from the data's 512"),
             (edited, [], "meta.json is damaged (vocab_size 600 is not the vocabulary of its encoding 'cl100k_512')"),
             (renamed, [], "train.bin ends with token id 511, not the end-of-text id 599 of meta.json's vocab_size")]
    for d, extra, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(cli(d, tmp_path / "run", *extra, tokens=64))
        assert e.value.code == 2 and msg in capsys.readouterr().err
        assert not (tmp_path / "run").exists()
    (bad / "train.bin").write_bytes((data / "train.bin").read_bytes()[:-2])
    with pytest.raises(SystemExit):
        main(cli(bad, tmp_path / "run", tokens=64))
    assert "meta.json says" in capsys.readouterr().err


HOLDS_THE_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_directory_in_use_by_another_run_is_refused(data, tmp_path, capsys):
    """Another process holds the run directory's lock: a fresh run and a resume on it are refused
    and change nothing; once that process is killed (-9), its lock is gone with it."""
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", "--stop-after", "1", tokens=3 * 32))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK, str(out / ".lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        for extra in (["--resume"], []):
            with pytest.raises(SystemExit) as e:
                main(cli(data, out, "--eval-every", "0", *extra, tokens=3 * 32))
            assert e.value.code == 2
            assert f"error: {out} is in use by another run" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=3 * 32))
    assert [r["step"] for r in metrics(out)] == ["1", "2", "3"]


def test_evaluate_cli_equals_the_trainers_validation(data, tmp_path, capsys):
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", tokens=4 * 32))
    final = metrics(out)[-1]
    table = tmp_path / "eval.csv"
    for _ in range(2):
        evaluate_main([str(out / "ckpt.pt"), "--data", str(data), "--streams", "2", "--chunk-len", "16",
                       "--csv", str(table)])
    assert "nats/token" in capsys.readouterr().out
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["git_sha"] and r["date"] and r["split"] == "val" and r["eval"] == "carried"
                                  for r in rows)
    assert float(rows[0]["ce"]) == pytest.approx(float(final["val_ce"]), rel=1e-6)
    assert float(rows[0]["bpb"]) == pytest.approx(float(final["val_bpb"]), rel=1e-6)
    assert rows[0]["ce"] == rows[1]["ce"] and float(rows[0]["ppl"]) == pytest.approx(math.exp(float(rows[0]["ce"])))
    # bits per byte from the targets' own bytes: CE · targets / ln 2 / bytes (end-of-text: 0 bytes)
    enc = get_tokenizer(512)
    streams = TokenStreams(load_tokens(data, "val"), 2, 16)
    targets = torch.cat([streams.next()[1].flatten() for _ in range(streams.chunks_per_epoch)]).tolist()
    n_bytes = sum(len(enc.decode_single_token_bytes(t)) for t in targets if t != enc.eot_token)
    assert int(rows[0]["tokens"]) == len(targets)
    assert float(rows[0]["bpb"]) == pytest.approx(float(rows[0]["ce"]) * len(targets) / math.log(2) / n_bytes,
                                                  rel=1e-9)
    with pytest.raises(SystemExit) as e:
        evaluate_main([str(out / "ckpt.pt"), "--data", str(data), "--csv", str(tmp_path)])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err
    other = tmp_path / "other"
    prepare(str(write_toy_corpus(tmp_path / "c.txt")), other, vocab_size=300)
    with pytest.raises(SystemExit) as e:
        evaluate_main([str(out / "ckpt.pt"), "--data", str(other)])
    assert e.value.code == 2 and "vocab_size 512, the data" in capsys.readouterr().err


def test_records_gives_each_metrics_row_the_process_that_trained_it(data, tmp_path, monkeypatch):
    """A run stopped and resumed: each row gets its own process's provenance (the checkpoint's
    sessions), every row the final weights' fingerprint; a run stopped where it validated, and an
    unrecorded run, are refused; a finished run validated again gets that process on its last row."""
    processes = iter(range(10))
    monkeypatch.setattr(loop, "provenance", lambda device: {"git_sha": "s", "date": f"process {next(processes)}"})
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "3", "--stop-after", "3", tokens=8 * 32))
    assert metrics(out)[-1]["val_ce"]  # validated at its last row, yet not finished
    with pytest.raises(ValueError, match="at step 3 of 8"):
        records.run_rows(out)
    train(cli(data, out, "--eval-every", "3", "--resume", tokens=8 * 32))
    rows = records.run_rows(out, "label")
    assert [r["date"] for r in rows] == ["process 0"] * 3 + ["process 1"] * 5
    ck = load_checkpoint(out / "ckpt.pt")
    assert {(r["run"], r["weights"]) for r in rows} == {("label", weights_fingerprint(ck["model"]))}
    assert [{k: r[k] for k in SAME} for r in rows] == metrics(out)
    train(cli(data, out, "--eval-every", "3", "--resume", tokens=8 * 32))  # finished: validates again
    assert [s["date"] for s in load_checkpoint(out / "ckpt.pt")["sessions"]] == ["process 0", "process 1", "process 2"]
    assert [r["date"] for r in records.run_rows(out)] == ["process 0"] * 3 + ["process 1"] * 4 + ["process 2"]
    ck.pop("sessions")
    save_checkpoint(out / "ckpt.pt", ck)
    with pytest.raises(ValueError, match="does not record where step 1 was trained"):
        records.run_rows(out)


def test_records_cli(data, tmp_path, capsys):
    out, table = tmp_path / "run", tmp_path / "metrics.csv"
    train(cli(data, out, "--eval-every", "0", tokens=4 * 32))
    records.main([str(out), "--out", str(table)])
    assert "4 rows" in capsys.readouterr().out
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [*METRIC_FIELDS, "run", "weights", *records.provenance()]
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and rows[0]["run"] == str(out)
    assert rows[0]["git_sha"] == records.git_sha() and rows[-1]["val_ce"] == metrics(out)[-1]["val_ce"]
    for argv, message in (([str(out), "--out", str(table)], "exists (--force replaces it)"),
                          ([str(out), "--out", str(tmp_path)], "is a directory"),
                          ([str(tmp_path / "none"), "--out", str(tmp_path / "x.csv")], "does not exist")):
        with pytest.raises(SystemExit) as e:
            records.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    records.main([str(out), "--out", str(table), "--label", "again", "--force"])
    with open(table, newline="") as f:
        assert {r["run"] for r in csv.DictReader(f)} == {"again"}
    lines = (out / "metrics.csv").read_text().splitlines(keepends=True)
    (out / "metrics.csv").write_text(lines[0] + "".join(lines[3:]))  # steps 3 and 4: a resume's after a loss
    with pytest.raises(SystemExit) as e:
        records.main([str(out), "--out", str(table), "--force"])
    assert e.value.code == 2 and "does not hold one row for each of steps 1–4, in order (2 rows from step 3)" \
        in capsys.readouterr().err


def test_sample_cli(data, tmp_path, capsys):
    """`python -m fractus.sample`: the same text for the same seed, one line per prompt and sample,
    greedy equal to the model's own greedy generation; bad arguments and files exit with code 2."""
    from fractus.sample import main as sample_main
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", "--sample-tokens", "4", tokens=2 * 32))
    assert "--- 'Once upon a time' →" in capsys.readouterr().out  # the trainer's samples at the end
    ckpt = str(out / "ckpt.pt")
    args = [ckpt, "--prompt", "To be", "--prompt", "or not", "--tokens", "8", "--num-samples", "2"]
    sample_main(args)
    first = capsys.readouterr().out.splitlines()
    sample_main(args)
    assert capsys.readouterr().out.splitlines() == first and len(first) == 4
    assert [line.split(" →")[0] for line in first] == ["--- 'To be'"] * 2 + ["--- 'or not'"] * 2
    assert first[0] != first[1]  # sample i uses seed + i
    model = FractusCTE.load(ckpt)
    enc = get_tokenizer(512)
    sample_main([ckpt, "--prompt", "To be", "--tokens", "8", "--temperature", "0"])
    greedy = enc.decode(model.generate(enc.encode_ordinary("To be"), 8, temperature=0))
    assert capsys.readouterr().out.strip() == f"--- 'To be' →{greedy!r}"
    for bad in (["--top-k", "-1"], ["--top-p", "0"], ["--temperature", "-1"], ["--tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            sample_main([ckpt, *bad])
        assert e.value.code == 2 and "must be" in capsys.readouterr().err
    for bad, msg in (([str(tmp_path / "none.pt")], "does not exist"), ([ckpt, "--prompt", ""], "prompt is empty")):
        with pytest.raises(SystemExit) as e:
            sample_main(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="top_k must be an integer ≥ 1"):
        model.generate([1, 2], 3, top_k=0)
