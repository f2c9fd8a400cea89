"""What ``--resume`` refuses (:mod:`fractus.training.resume`): malicious, truncated, model-only and
mangled checkpoints, each named; other settings, another corpus, a lost or damaged metrics record;
and what it accepts: the same settings written otherwise, from another working directory."""
import os
import shutil
from pathlib import Path

import pytest
import torch

import fractus.training.loop as loop
from fractus.checkpoint import load_checkpoint, save_checkpoint
from fractus.data import prepare, write_toy_corpus
from fractus.model import FractusConfig, FractusCTE
from fractus.training import records
from fractus.training.command import main, train
from fractus.training.optim import ADAMW_LR
from fractus.training.resume import RESUME_KEYS
from util import cli, make_corpus, metrics


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


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
        monkeypatch.setattr(loop, "load_checkpoint", lambda path: bad)
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
           "min_lr_ratio": ["--min-lr-ratio", "0.5"], "lr_shape": ["--lr-shape", "wsd"],
           "decay_fraction": ["--decay-fraction", "0.5"], "grad_clip": ["--grad-clip", "0.5"],
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
