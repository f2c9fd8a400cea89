"""One run of the trainer (:mod:`fractus.training.loop`): a run stopped any way (kill -9, a
signal, ``--stop-after``, a kill inside a save, a failing save) resumes to the uninterrupted run's
record; non-finite losses, gradients and weights; PGSU, growth and each step's own training CE."""
import os
import signal
import time

import numpy as np
import pytest
import torch

import fractus.training.loop as loop
from fractus.checkpoint import load_checkpoint, save_checkpoint
from fractus.data import TokenStreams, load_tokens
from fractus.model import FractusConfig, FractusCTE
from fractus.training.command import main, train
from fractus.training.optim import ADAMW_LR, warmup_steps
from fractus.training.steps import micro_steps, set_active_blocks
from fractus.training.stopping import Interrupted, NonFiniteLoss, Stop
from util import STEPS, cli, make_corpus, metrics, popen, wait_for_rows


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
    monkeypatch.setattr(loop, "micro_steps", nan_from_the_second)
    with pytest.raises(Interrupted) as e:
        train(cli(data, tmp_path / "run", "--eval-every", "0", "--max-nan", "3", tokens=6 * 32))
    assert e.value.signum == signal.SIGINT and len(calls) == 2
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 1


def test_a_signal_during_the_last_step_skips_the_final_validation(data, tmp_path, monkeypatch):
    """The last step's stop request comes after its agreement: it is asked again once the loop ends."""
    real = loop.append_metrics

    def signal_at_the_end(path, row):
        real(path, row)
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(loop, "append_metrics", signal_at_the_end)
    out = tmp_path / "run"
    with pytest.raises(Interrupted) as e:
        train(cli(data, out, "--eval-every", "0", tokens=3 * 32))
    assert e.value.signum == signal.SIGTERM and load_checkpoint(out / "ckpt.pt")["step"] == 3
    assert metrics(out)[-1]["val_ce"] == ""  # no final validation row: `--resume` validates it


def test_stop_after_exits_with_0(data, tmp_path):
    main(cli(data, tmp_path / "run", "--eval-every", "0", "--stop-after", "2", tokens=4 * 32))  # no SystemExit
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 2


def test_a_stop_request_reaches_the_sigterm_handler_it_replaced():
    """Inside a caller with its own SIGTERM handler (the GPU suite's), the trainer finishes and saves,
    then hands the signal on; SIGINT and the default SIGTERM are not handed on."""
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
from fractus.training.command import main
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
    orig, calls = loop.micro_steps, []

    def micro_steps(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            args[0].embed.weight.grad[0, 0] = float("inf")  # args[0]: the model (one process)
        return out
    monkeypatch.setattr(loop, "micro_steps", micro_steps)
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
    monkeypatch.setattr(loop, "evaluate_text", interrupted)
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
    monkeypatch.setattr(loop, "save_checkpoint", save)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(cli(data, out, "--eval-every", "0", "--ckpt-every", "2", tokens=6 * 32))
    assert e.value.code == 2 and "No space left on device" in capsys.readouterr().err
    assert saves == [2, 4] and load_checkpoint(out / "ckpt.pt")["step"] == 2
    monkeypatch.undo()
    train(cli(data, out, "--eval-every", "0", "--resume", tokens=6 * 32))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 6
