"""The trainer under faults: kill -9 and resume, a kill inside a save, malicious and mangled
checkpoints, non-finite losses, bad input, mismatched resumes, a run directory in use, a lost or
damaged metrics record; PGSU and growth through the CLI."""
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fractus.training.loop as train_mod
from fractus.training import records
from fractus.checkpoint import load_checkpoint, save_checkpoint, weights_fingerprint
from fractus.data import TokenStreams, load_tokens, prepare, write_toy_corpus
from fractus.data import main as data_main
from fractus.evaluate import main as evaluate_main
from fractus.model import FractusConfig, FractusCTE
from fractus.training.resume import ADAMW_LR, RESUME_KEYS, warmup_steps
from fractus.training.runs import METRIC_FIELDS
from fractus.tokenizer import get_tokenizer
from fractus.training.loop import NonFiniteLoss, main, micro_steps, set_active_blocks, train
from util import ROOT, SAME, STEPS, cli, make_corpus, metrics


def popen(argv, script=None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", script, *argv] if script else [sys.executable, "-m", "fractus.train", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(proc, out: Path, n: int, timeout: float = 120) -> None:
    """Until the run has a checkpoint and n rows of metrics."""
    deadline = time.monotonic() + timeout
    while not ((out / "ckpt.pt").exists() and (out / "metrics.csv").exists()
               and len((out / "metrics.csv").read_text().splitlines()) > n):
        assert proc.poll() is None, f"the run ended before it was interrupted: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {n} rows of metrics after {timeout} s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """metrics.csv of an uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    train(cli(data, out))
    rows = metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1)) and rows[-1]["val_ce"]  # a row per step
    return rows


def test_the_default_warm_up_is_five_percent_of_the_run_s_steps(reference):
    """The reference run's 80 steps warm up over 4: each row records the rate of the next step,
    (s + 1)/4 of the peak at step s, then the peak, then the cosine decay."""
    assert warmup_steps(None, 1465) == 73 and warmup_steps(None, 13184) == 659 and warmup_steps(50, 1465) == 50
    lr = [float(r["lr"]) / ADAMW_LR["cte"] for r in reference]
    assert lr[:4] == pytest.approx([0.5, 0.75, 1.0, 1.0]) and lr[4] < 1.0


def test_kill9_then_resume_equals_uninterrupted(data, reference, tmp_path):
    out = tmp_path / "run"
    proc = popen(cli(data, out))
    try:
        wait_for_rows(proc, out, 12)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    step = load_checkpoint(out / "ckpt.pt")["step"]
    assert 5 <= step < STEPS and step % 5 == 0
    train(cli(data, out, "--resume"))
    assert metrics(out) == reference


def test_stop_after_then_resume_equals_uninterrupted(data, reference, tmp_path, capsys):
    out = tmp_path / "run"
    train(cli(data, out, "--stop-after", "7"))
    assert f"stopped at step 7 of {STEPS}" in capsys.readouterr().out
    assert load_checkpoint(out / "ckpt.pt")["step"] == 7 and len(metrics(out)) == 7
    train(cli(data, out, "--resume", "--stop-after", str(STEPS)))  # past the end: runs to it
    assert metrics(out) == reference
    train(cli(data, out, "--resume"))  # a finished run: validates again and rewrites its last row
    assert metrics(out) == reference


def test_a_checkpoint_whose_config_names_the_chunk_length_resumes_exactly(data, reference, tmp_path):
    """The chunk length is the trainer's setting (its arguments), not the model's: a saved config
    that also names it resumes as if it did not."""
    out = tmp_path / "run"
    train(cli(data, out, "--stop-after", "7"))
    ck = load_checkpoint(out / "ckpt.pt")
    save_checkpoint(out / "ckpt.pt", {**ck, "config": {**ck["config"], "chunk_len": ck["args"]["chunk_len"]}})
    train(cli(data, out, "--resume"))
    assert metrics(out) == reference


def test_streams_stop_then_resume_equals_uninterrupted(data, tmp_path):
    """The other reading of the split, contiguous streams with the state carried, resumes exactly too."""
    streams = ("--sampling", "streams")
    train(cli(data, tmp_path / "reference", *streams))
    out = tmp_path / "run"
    train(cli(data, out, *streams, "--stop-after", "7"))
    train(cli(data, out, *streams, "--resume"))
    assert metrics(out) == metrics(tmp_path / "reference")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_where_it_stopped_and_exits_with_its_code(data, tmp_path, signum):
    """Saved and resumable, but not 0: `train && evaluate` must not go on (130 for Ctrl-C, 143 for SIGTERM)."""
    out = tmp_path / "run"
    proc = popen(cli(data, out))
    try:
        wait_for_rows(proc, out, 3)
        proc.send_signal(signum)
    finally:
        stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and "checkpoint saved" in stdout and "rerun with --resume" in stdout
    step = load_checkpoint(out / "ckpt.pt")["step"]
    assert 3 <= step < STEPS and int(metrics(out)[-1]["step"]) == step


def test_a_signal_during_a_skipped_step_stops_the_run(data, tmp_path, monkeypatch):
    """Ctrl-C while steps are being skipped (non-finite): it stops there, not after --max-nan skips."""
    real, calls = micro_steps, []

    def nan_from_the_second(*args, **kwargs):
        ce, lb, state, finite = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return ce, lb, state, finite and len(calls) < 2
    monkeypatch.setattr(train_mod, "micro_steps", nan_from_the_second)
    with pytest.raises(train_mod.Interrupted) as e:
        train(cli(data, tmp_path / "run", "--eval-every", "0", "--max-nan", "3", tokens=6 * 32))
    assert e.value.signum == signal.SIGINT and len(calls) == 2
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 1


def test_a_signal_during_the_last_step_skips_the_final_validation(data, tmp_path, monkeypatch):
    """The last step's stop request comes after its agreement: it is asked again once the loop ends."""
    real = train_mod.append_metrics

    def signal_at_the_end(path, row):
        real(path, row)
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(train_mod, "append_metrics", signal_at_the_end)
    out = tmp_path / "run"
    with pytest.raises(train_mod.Interrupted) as e:
        train(cli(data, out, "--eval-every", "0", tokens=3 * 32))
    assert e.value.signum == signal.SIGTERM and load_checkpoint(out / "ckpt.pt")["step"] == 3
    assert metrics(out)[-1]["val_ce"] == ""  # no final validation row: `--resume` validates it


def test_stop_after_exits_with_0(data, tmp_path):
    main(cli(data, tmp_path / "run", "--eval-every", "0", "--stop-after", "2", tokens=4 * 32))  # no SystemExit
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 2


def test_a_stop_request_reaches_the_sigterm_handler_it_replaced():
    """Inside a caller with its own SIGTERM handler (the GPU suite's), the trainer finishes and saves,
    then hands the signal on; SIGINT and the default SIGTERM are not handed on."""
    from fractus.training.loop import Stop
    got = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with Stop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert stop.requested and got == []  # the trainer's step goes on first
        assert got == [signal.SIGTERM]
        with Stop() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert stop.requested and got == [signal.SIGTERM]  # no KeyboardInterrupt either
    finally:
        signal.signal(signal.SIGTERM, old)


KILLED_IN_SAVE = """
import io, os, signal, sys
import torch
from fractus.training.loop import main
real, calls = torch.save, []
def save(obj, f, *args, **kwargs):  # the third checkpoint: half the bytes, then SIGKILL
    calls.append(1)
    if len(calls) < 3:
        return real(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real(obj, buf, *args, **kwargs)
    f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = save
main(sys.argv[1:])
"""


def test_kill_inside_a_save_keeps_the_previous_checkpoint(data, reference, tmp_path, capsys):
    """The half-written temporary stays until the run resumes (under the run's lock: no other
    writer), which removes it and says so."""
    out = tmp_path / "run"
    proc = popen(cli(data, out), script=KILLED_IN_SAVE)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert load_checkpoint(out / "ckpt.pt")["step"] == 10, "the previous checkpoint is intact"
    temps = list(out.glob(".ckpt.pt.*.tmp"))
    assert temps, "the half-written file was a temporary"
    (out / ".metrics.csv.0123456789ab.tmp").touch()  # a kill at a rewrite's start: an empty one
    train(cli(data, out, "--resume"))
    assert metrics(out) == reference
    assert f"removed 2 temporary file(s) of an interrupted write: {temps[0].name}" in capsys.readouterr().out
    assert not list(out.glob(".*.tmp"))


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


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_resume_refuses_malicious_truncated_and_model_only_checkpoints(data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"config": {}, "model": {}, "x": RunsCode(marker)}, out / "ckpt.pt")
    for fill, msg in [(None, "refusing to load"), ("truncated", "truncated or not a checkpoint"),
                      ("model", "no training state")]:
        if fill == "truncated":
            FractusCTE(FractusConfig.preset("tiny")).save(out / "ckpt.pt")
            (out / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:300])
        elif fill == "model":
            FractusCTE(FractusConfig.preset("tiny")).save(out / "ckpt.pt")
        with pytest.raises(SystemExit) as e:
            main(cli(data, out, "--resume"))
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not marker.exists()


def mangled(ck: dict, field: str, value=None, delete: bool = False) -> dict:
    """``ck`` with ``field`` (``a/b/c``: nested; ``*``: every entry) set to ``value``, or deleted; the
    containers on the way are copied, the rest is shared."""
    def edit(node, keys):
        node = dict(node) if isinstance(node, dict) else list(node)
        key, *rest = keys
        for k in (list(node) if isinstance(node, dict) else range(len(node))) if key == "*" else \
                [key if isinstance(node, dict) else int(key)]:
            if rest:
                node[k] = edit(node[k], rest)
            elif delete:
                del node[k]
            else:
                node[k] = value
        return node
    return edit(ck, field.split("/"))


MANGLED = [  # (field, value or "delete", what the error says)
    ("step", "delete", "lacks the training state's 'step'"),
    ("step", "3", "'step' must be an integer ≥ 0, got '3'"),
    ("data_position", -1, "'data_position' must be an integer ≥ 0, got -1"),
    ("elapsed_s", float("nan"), "'elapsed_s' must be a finite number ≥ 0, got nan"),
    ("args", "delete", "lacks the training state's 'args'"),
    ("args", [1], "'args' must be a dict of the trainer's arguments, got [1]"),
    ("args/optimizer", "adam", "'args' entry 'optimizer' must be one of ['adamw', 'rmsprop', 'sgd'], got 'adam'"),
    ("args/data", "delete", "'args' entry 'data' must be a str, got None"),
    ("args/device", "gpu0", "'args' entry 'device' must be a device's name, got 'gpu0'"),
    ("args/tokens", torch.ones(2), "'args' entry 'tokens' must be an integer ≥ 1, got a torch.float32 tensor"),
    ("states", "delete", "lacks the training state's 'states'"),
    ("states", [], "'states' must hold the carried state of each of its 1 process(es), got 0"),
    ("states", {0: None}, "'states' must be a list of every process's carried state"),
    ("states/0", [(torch.zeros(2), torch.zeros(2))], "'states' entry 0 must be None or one tuple of tensors per block shaped"),
    ("states/0/0", "S", "'states' entry 0 must be None or one tuple of tensors per block shaped"),
    ("counters", {}, "'counters' must be {'nan_run': an integer ≥ 0, 'skipped': an integer ≥ 0}, got {}"),
    ("counters/skipped", 1.5, "'counters' must be {'nan_run'"),
    ("optimizer", "delete", "lacks the training state's 'optimizer'"),
    ("optimizer", {}, "'optimizer' must be an optimizer's state_dict (state, param_groups), got {}"),
    ("optimizer/param_groups", [], "'optimizer' does not fit this run's optimizer (ValueError: loaded state dict "
                                   "has a different number of parameter groups"),
    ("optimizer/param_groups/0/lr", "fast", "'optimizer' parameter group 0: lr must be a finite number, got 'fast'"),
    ("optimizer/param_groups/1/betas", (0.9,), "parameter group 1: betas must be 2 finite numbers, got (0.9,)"),
    ("optimizer/state/*/exp_avg", torch.zeros(3), "'optimizer' holds for a parameter of shape (512, 32) a "
                                                  "'exp_avg' that is a torch.float32 tensor of shape (3,)"),
    ("optimizer/state/*/exp_avg_sq", "x", "'optimizer' state of parameter 0 must be a dict of tensors and numbers"),
    ("scheduler", "delete", "lacks the training state's 'scheduler'"),
    ("scheduler/last_epoch", 1, "'scheduler' must be at step 2 with 2 parameter groups"),
    ("scheduler/base_lrs", [0.002], "'scheduler' must be at step 2 with 2 parameter groups"),
    ("rng", "delete", "lacks the training state's 'rng'"),
    ("rng/torch", torch.zeros(3, dtype=torch.uint8), "'rng' must be RNG states"),
    ("rng/cuda", "x", "'rng' must be RNG states"),
    ("ancestor", None, "'ancestor' must be a weights fingerprint (str), got None"),
    ("world", 0, "'world' must be an integer ≥ 1, got 0"),
    ("sessions", [{"date": "x"}], "'sessions' must be a list of dicts with a from_step ≥ 0"),
    ("meta", {"vocab_size": torch.ones(3)}, "'meta' must be a dict of plain values"),
    ("config/n_layers", 0, ": its config is not a valid one (bad config: n_layers must be"),
]


def test_resume_names_a_missing_or_mangled_training_state_field(data, tmp_path, capsys, monkeypatch):
    """Each field of the training state that is missing or not what the trainer writes: exit code 2
    and an error naming the field and what it must be (not a KeyError, TypeError or IndexError, nor a
    failure in the optimizer's step); nothing is written. `records` refuses such a checkpoint too."""
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", "--stop-after", "2", tokens=3 * 32))
    ck = load_checkpoint(out / "ckpt.pt")
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    for field, value, msg in MANGLED:  # as read from the file (the file's own checks are test_checkpoint's)
        bad = mangled(ck, field, value, delete=value == "delete")
        monkeypatch.setattr(train_mod, "load_checkpoint", lambda path: bad)
        with pytest.raises(SystemExit) as e:
            main(cli(data, out, "--eval-every", "0", "--resume", tokens=3 * 32))
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: {out / 'ckpt.pt'}" in err and msg in err, (field, err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    save_checkpoint(out / "ckpt.pt", mangled(ck, "args/tokens", "many"))
    with pytest.raises(SystemExit) as e:  # not a TypeError
        records.main([str(out), "--out", str(tmp_path / "t.csv")])
    assert e.value.code == 2 and "'args' entry 'tokens' must be an integer ≥ 1" in capsys.readouterr().err
    FractusCTE(FractusConfig.preset("tiny")).save(out / "ckpt.pt")
    with pytest.raises(SystemExit) as e:  # not a KeyError
        records.main([str(out), "--out", str(tmp_path / "t.csv")])
    assert e.value.code == 2 and "holds a model but no training state" in capsys.readouterr().err


def inject_nan(monkeypatch, bad):
    """Make the training loss non-finite on the training forwards n (1-based) with bad(n)."""
    orig, calls = FractusCTE.forward, []

    def forward(self, *args, **kwargs):
        logits, parts, state = orig(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if bad(len(calls)):
                parts = {**parts, "loss": parts["loss"] * float("nan")}
        return logits, parts, state

    monkeypatch.setattr(FractusCTE, "forward", forward)


def test_nan_step_is_skipped_with_a_message(data, tmp_path, monkeypatch, capsys):
    inject_nan(monkeypatch, lambda n: n == 3)
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", tokens=6 * 32))
    assert "step 2: non-finite loss, step skipped (1/3 in a row)" in capsys.readouterr().out
    rows = metrics(out)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(float(r["train_ce"])) for r in rows)
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["data_position"] == 7, "the bad chunk is skipped"
    assert ck["counters"] == {"nan_run": 0, "skipped": 1}, "a resumed run counts on from here"


def test_non_finite_gradient_under_a_finite_loss_is_skipped(data, tmp_path, monkeypatch, capsys):
    """An overflow in the backward: the step is skipped and the weights stay finite (clipping an
    infinite norm would write NaN into every weight)."""
    orig, calls = train_mod.micro_steps, []

    def micro_steps(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            args[0].embed.weight.grad[0, 0] = float("inf")  # args[0]: the model (one process)
        return out
    monkeypatch.setattr(train_mod, "micro_steps", micro_steps)
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", tokens=6 * 32))
    assert "step 2: non-finite gradient, step skipped (1/3 in a row)" in capsys.readouterr().out
    rows = metrics(out)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    norms = [float(r["grad_norm"]) for r in rows[:-1]]
    assert all(np.isfinite(n) and n > 0 for n in norms), norms
    ck = load_checkpoint(out / "ckpt.pt")
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
    assert ck["counters"]["skipped"] == 1


def test_every_micro_step_runs_its_backward_when_a_loss_is_nan():
    """Under DDP every rank must make the same all-reduces: a non-finite loss on one rank's first
    micro-step still runs that backward and the later micro-steps' (the caller drops the gradients)."""
    model = FractusCTE(FractusConfig.preset("tiny"))
    backwards = []
    model.embed.weight.register_hook(lambda g: backwards.append(1))

    def fwd(x, state, y, head_positions):
        _, parts, state = model(x, state, y, head_positions)
        if not backwards:
            parts = {**parts, "loss": parts["loss"] * float("nan")}
        return None, parts, state
    x = torch.randint(0, 512, (2, 9))
    ce, lb, _, finite = micro_steps(fwd, iter([(x[:, :-1], x[:, 1:], False)] * 3), None, 3, "all",
                                    torch.device("cpu"), False)
    assert not finite and np.isnan(ce) and np.isnan(lb) and len(backwards) == 3


def test_repeated_nan_stops_after_saving(data, tmp_path, monkeypatch, capsys):
    inject_nan(monkeypatch, lambda n: n >= 3)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match=r"3 consecutive non-finite steps \(the last: loss\) at step 2"):
        train(cli(data, out, "--eval-every", "0", "--max-nan", "3", tokens=20 * 32))
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["step"] == 2 and ck["data_position"] == 5
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
    with pytest.raises(SystemExit) as e:
        main(cli(data, tmp_path / "run2", "--eval-every", "0", tokens=20 * 32))
    assert e.value.code == 2 and "consecutive non-finite steps" in capsys.readouterr().err


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
    args = train_mod.build_parser().parse_args(["--data", "d", "--out", "o", "--set", "n_layers=3",
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


def test_non_finite_weights_never_replace_the_last_checkpoint(data, tmp_path, monkeypatch, capsys):
    """An update with a finite gradient can still overflow the weights (a huge lr): the checkpoint
    of the step before stays."""
    real, calls = torch.optim.AdamW.step, []

    def step_then_overflow(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_overflow)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(cli(data, out, "--eval-every", "0", "--ckpt-every", "1", tokens=10 * 32))
    assert e.value.code == 2 and "the weights became non-finite by step 3" in capsys.readouterr().err
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["step"] == 2 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_resume_refuses_another_corpus_in_the_same_directory(data, tmp_path, capsys):
    here, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(data, here)
    train(cli(here, out, "--eval-every", "0", tokens=2 * 32))
    shutil.rmtree(here)  # prepared again, from another text of the same name
    prepare(str(write_toy_corpus(tmp_path / "corpus.txt", seed=1)), here, vocab_size=512)
    with pytest.raises(SystemExit) as e:
        main(cli(here, out, "--eval-every", "0", "--resume", tokens=4 * 32))
    assert e.value.code == 2 and "'data train_tokens'" in capsys.readouterr().err


def test_resume_refuses_a_lost_or_damaged_metrics_record(data, tmp_path, capsys):
    """metrics.csv is the run's record of every step: a resume without all of it (deleted, rows
    lost) is refused rather than leaving a record that starts at the resume step, and a file that
    is not one is named."""
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", "--stop-after", "3", tokens=4 * 32))
    record = (out / "metrics.csv").read_text()
    lines = record.splitlines(keepends=True)
    cases = [(None, f"but {out / 'metrics.csv'}, the record of steps 1–3, does not exist"),
             ("".join(lines[:2] + lines[3:]), "lacks the rows of 1 of them (the first: step 2)"),
             ("".join(lines + lines[1:]), "holds them out of order or more than once"),
             (record.replace("\n2,", "\nx,", 1), f"{out / 'metrics.csv'} is not a metrics file of this trainer: "
                                                 "line 3: step 'x' is not a step number"),
             (lines[0].replace("step", "stop") + "".join(lines[1:]), "is not a metrics file of this trainer: its "
                                                                     "header has no step column"),
             (lines[0] + lines[1].replace("\n", ",1\n") + "".join(lines[2:]),
              "line 2 has more values than the header has columns"),
             (b"\xff\xfe" * 9, "is not a metrics file of this trainer: 'utf-8' codec can't decode")]
    for content, msg in cases:
        (out / "metrics.csv").unlink(missing_ok=True)
        if isinstance(content, bytes):
            (out / "metrics.csv").write_bytes(content)
        elif content is not None:
            (out / "metrics.csv").write_text(content)
        with pytest.raises(SystemExit) as e:
            main(cli(data, out, "--eval-every", "0", "--resume", tokens=4 * 32))
        assert e.value.code == 2 and msg in capsys.readouterr().err, msg
        assert load_checkpoint(out / "ckpt.pt")["step"] == 3
    (out / "metrics.csv").write_text(record + "4,")  # a row cut by a kill is no damage
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=4 * 32))
    assert [r["step"] for r in metrics(out)] == ["1", "2", "3", "4"]


def test_resume_from_another_working_directory(data, tmp_path, monkeypatch):
    """The checkpoint records the data directory as an absolute path: a resume from elsewhere,
    naming it otherwise, continues; a checkpoint that records a relative path is matched on the
    data's identity."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    relative = os.path.relpath(data)
    train(cli(relative, "run", "--eval-every", "0", "--stop-after", "1", tokens=3 * 32))
    ck = load_checkpoint("run/ckpt.pt")
    assert ck["args"]["data"] == str(data.resolve())
    monkeypatch.chdir(tmp_path / "b")
    out = tmp_path / "a" / "run"
    train(cli(data, out, "--eval-every", "0", "--resume", "--stop-after", "1", tokens=3 * 32))
    ck = load_checkpoint(out / "ckpt.pt")
    save_checkpoint(out / "ckpt.pt", {**ck, "args": {**ck["args"], "data": relative}})  # a relative path
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=3 * 32))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 3


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


def test_resume_refuses_other_settings(data, tmp_path, capsys):
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", tokens=5 * 32))
    cases = [(["--resume", "--batch-size", "3"], "--resume with different settings"),
             (["--resume", "--set", "n_layers=3"], "'config n_layers': (2, 3)"),
             (["--resume", "--lr", "1e-4"], f"'lr': ({ADAMW_LR['cte']}, 0.0001)"),  # the restored optimizer would ignore it
             (["--resume", "--weight-decay", "0.5"], "'weight_decay': (0.1, 0.5)"),
             ([], "exists: pass --resume")]
    for extra, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(cli(data, out, "--eval-every", "0", *extra, tokens=10 * 32))
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(cli(data, tmp_path / "none", "--resume"))
    assert "no checkpoint at" in capsys.readouterr().err
    ck = load_checkpoint(out / "ckpt.pt")
    save_checkpoint(out / "ckpt.pt", {**ck, "world": 2})  # as if written by 2 processes
    with pytest.raises(SystemExit):
        main(cli(data, out, "--eval-every", "0", "--resume", tokens=10 * 32))
    assert "'processes': (2, 1)" in capsys.readouterr().err
    save_checkpoint(out / "ckpt.pt", {**ck, "args": {**ck["args"], "device": "cuda"}})  # bf16 by default there
    with pytest.raises(SystemExit):
        main(cli(data, out, "--eval-every", "0", "--resume", tokens=10 * 32))
    assert "'bf16': (True, False)" in capsys.readouterr().err
    save_checkpoint(out / "ckpt.pt", ck)
    # the same settings written otherwise: the data directory by another path, the defaults lr and bf16 explicitly
    relative = os.path.relpath(data, Path.cwd())
    assert not os.path.isabs(relative)
    train([*cli(data, out, "--eval-every", "0", "--resume", "--lr", str(ADAMW_LR["cte"]), "--no-bf16", tokens=6 * 32),
           "--data", relative])
    assert load_checkpoint(out / "ckpt.pt")["step"] == 6
    # the config as resolved: the preset's own values through --set, in any order, and another backend
    train(cli(data, out, "--eval-every", "0", "--resume", "--set", "n_layers=2", "d_model=32", "--backend", "torch",
              tokens=7 * 32))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 7


CHANGED = {"model": ["--model", "transformer"], "preset": ["--preset", "palier0"], "data": None, "batch_size": ["--batch-size", "3"],
           "chunk_len": ["--chunk-len", "8"], "sampling": ["--sampling", "streams"], "accum": ["--accum", "2"],
           "optimizer": ["--optimizer", "sgd"],
           "seed": ["--seed", "3"], "lr": ["--lr", "1e-4"],
           "weight_decay": ["--weight-decay", "0.5"], "warmup": ["--warmup", "7"],
           "min_lr_ratio": ["--min-lr-ratio", "0.5"], "grad_clip": ["--grad-clip", "0.5"],
           "lb_coef": ["--lb-coef", "0.1"], "head_positions": ["--head-positions", "last"],
           "detach_kuramoto": ["--detach-kuramoto"], "active_blocks": ["--active-blocks", "1"],
           "bf16": ["--bf16"]}  # on the CPU: the default is off


def test_resume_refuses_every_setting_that_shapes_the_run(data, tmp_path, capsys):
    assert set(CHANGED) == set(RESUME_KEYS)
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", tokens=2 * 32))
    other = tmp_path / "other"
    other.mkdir()
    for f in ("meta.json", "val.bin", "train.bin"):
        (other / f).write_bytes((data / f).read_bytes())
    for key, extra in CHANGED.items():
        argv = cli(other if key == "data" else data, out, "--eval-every", "0", "--resume", *(extra or []),
                   tokens=4 * 32)
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"'{key}'" in err, (key, err)


def test_pgsu_changes_only_the_active_blocks(data, tmp_path):
    out = tmp_path / "run"
    train(cli(data, out, "--eval-every", "0", "--active-blocks", "1", "--set", "n_layers=3", tokens=32))
    ck = load_checkpoint(out / "ckpt.pt")
    torch.manual_seed(1337)
    fresh = FractusCTE(FractusConfig.from_saved(ck["config"]))
    init = fresh.state_dict()
    active = set_active_blocks(fresh, 1, 1337, 0)
    changed = {k for k, v in ck["model"].items() if not torch.equal(v, init[k])}
    for i in range(3):
        in_block = {k for k in changed if k.startswith(f"blocks.{i}.")}
        assert bool(in_block) == (i in active), f"block {i}: {sorted(in_block)[:3]}"
    assert "embed.weight" in changed and "ln_f.weight" in changed


def test_pgsu_keeps_a_detached_clock_frozen():
    model = FractusCTE(FractusConfig.preset("tiny", n_layers=3, detach_kuramoto=True))
    for step in range(3):
        active = set_active_blocks(model, 2, 0, step)
        for i, blk in enumerate(model.blocks):
            assert all(p.requires_grad == (i in active) for p in blk.attn.parameters())
            assert not any(p.requires_grad for p in blk.clock.parameters())


def test_grow_from_cli_keeps_the_loss(data, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    train(cli(data, src, "--eval-every", "0", "--sampling", "streams", tokens=3 * 32))
    wider = ["--sampling", "streams", "--set", "d_model=64", "n_heads=4", "n_layers=3", "n_experts=6", "expert_d_ff=48"]
    train(cli(data, dst, "--eval-every", "0", "--grow-from", str(src / "ckpt.pt"), *wider, tokens=32))
    old = FractusCTE.load(src / "ckpt.pt")
    x, y, _ = TokenStreams(load_tokens(data, "train"), 2, 16).next()
    with torch.no_grad():
        ce = old(x, None, y)[1]["ce"].item()
    first = float(metrics(dst)[0]["train_ce"])
    assert abs(first - ce) / ce < 1e-4, (first, ce)
    assert load_checkpoint(dst / "ckpt.pt")["config"]["d_model"] == 64
    train(cli(data, dst, "--eval-every", "0", "--resume", *wider, tokens=2 * 32))  # a grown run resumes
    assert load_checkpoint(dst / "ckpt.pt")["step"] == 2
    with pytest.raises(SystemExit) as e:
        main(cli(data, tmp_path / "dst2", "--grow-from", str(src / "ckpt.pt"), "--set", "d_model=16",
                 "n_heads=1", tokens=32))
    assert e.value.code == 2 and "d_model 32 → 16 would shrink" in capsys.readouterr().err


def test_train_ce_is_each_steps_own_batch(data, tmp_path):
    """metrics.csv's train_ce at step n is the CE of step n's own batches (the mean of its micro-steps),
    not a running mean (the original's). With lr 0 the weights stay the initial ones, so each step's CE
    can be recomputed from the checkpoint, carrying the state across chunks as the trainer does."""
    out = tmp_path / "run"
    train(cli(data, out, "--lr", "0", "--accum", "2", "--eval-every", "0", "--sampling", "streams", tokens=6 * 64))
    model = FractusCTE.load(out / "ckpt.pt")
    streams = TokenStreams(load_tokens(data, "train"), 2, 16)
    state, want = None, []
    with torch.no_grad():
        for _ in range(6):
            ces = []
            for _ in range(2):
                x, y, new_epoch = streams.next()
                _, parts, state = model(x, None if new_epoch else state, y)
                ces.append(float(parts["ce"]))
            want.append(sum(ces) / 2)
    got = {int(r["step"]): float(r["train_ce"]) for r in reversed(metrics(out))}  # the final row repeats step 6
    assert [got[n] for n in range(1, 7)] == pytest.approx(want, rel=1e-5)
    assert max(want) - min(want) > 1e-3  # the batches differ: a running mean would not match


def test_interrupt_outside_the_training_loop(data, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the final validation: a message and exit code 130, not a traceback; the
    checkpoint of the last step is already written and a resume finishes the run."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    out = tmp_path / "run"
    monkeypatch.setattr(train_mod, "evaluate_text", interrupted)
    with pytest.raises(SystemExit) as e:
        main(cli(data, out, "--eval-every", "0", tokens=3 * 32))
    assert e.value.code == 130 and "interrupted; --resume continues" in capsys.readouterr().err
    assert load_checkpoint(out / "ckpt.pt")["step"] == 3 and not metrics(out)[-1]["val_ce"]
    monkeypatch.undo()
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=3 * 32))
    assert [r["step"] for r in metrics(out)] == ["1", "2", "3"] and metrics(out)[-1]["val_ce"]


def test_a_failing_save_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch, capsys):
    """A full disk while saving: `error: …` and exit code 2, and the last checkpoint written still
    resumes."""
    saves = []

    def save(path, payload):
        saves.append(payload["step"])
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        save_checkpoint(path, payload)
    monkeypatch.setattr(train_mod, "save_checkpoint", save)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(cli(data, out, "--eval-every", "0", "--ckpt-every", "2", tokens=6 * 32))
    assert e.value.code == 2 and "No space left on device" in capsys.readouterr().err
    assert saves == [2, 4] and load_checkpoint(out / "ckpt.pt")["step"] == 2
    monkeypatch.undo()
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=6 * 32))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 6


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
    monkeypatch.setattr(train_mod, "provenance", lambda device: {"git_sha": "s", "date": f"process {next(processes)}"})
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
