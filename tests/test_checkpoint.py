"""Checkpoint files: damaged bytes are caught by the zip CRCs, unreadable files and directories get
clear errors (exit code 2 from the CLIs), and the file mode follows the umask. The evaluation and
sampling CLIs: bad devices, non-finite weights and CSV files they cannot add to."""
import os
import random
import zipfile

import pytest
import torch

from fractus.atomic import atomic_open, leftover_temps
from fractus.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fractus.evaluate import main as evaluate_main
from fractus.model import FractusConfig, FractusCTE
from fractus.sample import main as sample_main
from fractus.training.command import main as train_main
from util import cli, make_corpus

UNREADABLE = "damaged, truncated or not a checkpoint"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "m.pt"
    FractusCTE(FractusConfig.preset("tiny")).save(path)
    return path


def member_data(path, name: str) -> tuple[int, int]:
    """(offset, size) of zip member ``name``'s bytes in ``path``."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name))
        with open(path, "rb") as f:
            f.seek(info.header_offset + 26)
            skip = int.from_bytes(f.read(2), "little") + int.from_bytes(f.read(2), "little")
        return info.header_offset + 30 + skip, info.file_size


def test_torch_save_writes_crcs_and_damaged_bytes_are_refused(ckpt, tmp_path):
    assert zipfile.ZipFile(ckpt).testzip() is None, "torch.save writes correct CRC-32s"
    data = ckpt.read_bytes()
    offset, size = member_data(ckpt, "data/0")
    mid = offset + size // 2
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[:mid] + b"\xff" * 8 + data[mid + 8:])  # silently NaN without the check
    assert zipfile.ZipFile(bad).testzip().endswith("data/0")
    with pytest.raises(CheckpointError, match=f"{UNREADABLE} .*member .*data/0 fails its CRC-32"):
        load_checkpoint(bad)
    offset, size = member_data(ckpt, "data.pkl")
    bad.write_bytes(data[:offset + 10] + b"\0" * 8 + data[offset + 18:])  # not "could run code"
    with pytest.raises(CheckpointError, match=f"{UNREADABLE} .*data.pkl"):
        load_checkpoint(bad)


@pytest.mark.parametrize("damage", ["empty", "text", "zeroed start", "zeroed end", "truncated"])
def test_unreadable_files_are_named_so(ckpt, tmp_path, damage):
    data = ckpt.read_bytes()
    bad = {"empty": b"", "text": b"hello world\n", "zeroed start": b"\0" * 8 + data[8:],
           "zeroed end": data[:-40] + b"\0" * 40, "truncated": data[:len(data) // 2]}[damage]
    (tmp_path / "bad.pt").write_bytes(bad)
    with pytest.raises(CheckpointError, match=UNREADABLE):
        load_checkpoint(tmp_path / "bad.pt")


def test_intact_file_with_code_is_refused_as_unsafe(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return os.system, ("true",)

    torch.save({"config": {}, "model": {}, "x": RunsCode()}, tmp_path / "evil.pt")
    assert zipfile.ZipFile(tmp_path / "evil.pt").testzip() is None
    with pytest.raises(CheckpointError, match="refusing to load .* could run code .*GLOBAL posix.system") as e:
        load_checkpoint(tmp_path / "evil.pt")
    assert "weights_only" not in str(e.value), "torch's advice to load it unsafely is not repeated"


@pytest.mark.parametrize("content", ["text", "random", "tokens"])
def test_files_that_are_no_zip_archive_are_not_checkpoints(tmp_path, content):
    bad = {"text": b"step,tokens\n1,128\n", "random": random.Random(0).randbytes(4096),
           "tokens": bytes(range(256)) * 8}[content]  # a train.bin: not "could run code"
    (tmp_path / "bad.pt").write_bytes(bad)
    with pytest.raises(CheckpointError, match=rf"{UNREADABLE} \(not a zip archive written by torch.save\)$") as e:
        load_checkpoint(tmp_path / "bad.pt")
    assert "weights_only" not in str(e.value)


def test_directories_are_named_so(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*: it is a directory"):
        save_checkpoint(tmp_path, {"config": {}, "model": {}})
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_an_interrupted_atomic_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_open(path) as f:
        f.write("half")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.csv"]
    with atomic_open(path) as f:
        f.write("new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.csv"]
    with pytest.raises(ValueError, match="mode 'w' or 'wb'"), atomic_open(path, "a"):
        pass
    with pytest.raises(FileNotFoundError, match="no folder"), atomic_open(tmp_path / "none" / "f.csv"):
        pass


def test_leftover_temporaries_are_only_atomic_opens_own(tmp_path):
    """What a run removes at its start: the temporaries atomic_open names for that file, not a
    user's files that look alike, nor another file's."""
    path = tmp_path / "ckpt.pt"
    with atomic_open(path, "wb") as f:
        (written,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        f.write(b"x")
    assert not written.exists()
    own = [tmp_path / ".ckpt.pt.0123456789ab.tmp", tmp_path / f".ckpt.pt.{written.name.split('.')[3]}.tmp"]
    others = [".ckpt.pt.notes.tmp", ".ckpt.pt.0123456789AB.tmp", ".ckpt.pt.0123456789abc.tmp",
              "ckpt.pt.0123456789ab.tmp", ".metrics.csv.0123456789ab.tmp", ".xckpt.pt.0123456789ab.tmp"]
    for p in own + [tmp_path / n for n in others]:
        p.touch()
    assert leftover_temps(path) == sorted(own)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "m.pt", {"config": {}, "model": {}})
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert oct((tmp_path / "m.pt").stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert (tmp_path / "m.pt").stat().st_mode == (tmp_path / "plain").stat().st_mode


@pytest.mark.parametrize("cmd", ["evaluate", "resume", "grow-from"])
@pytest.mark.parametrize("content", [b"", b"hello world\n"])
def test_clis_exit_2_on_unreadable_checkpoints(data, tmp_path, capsys, cmd, content):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(content)
    argv = {"evaluate": (evaluate_main, [str(out / "ckpt.pt"), "--data", str(data)]),
            "resume": (train_main, cli(data, out, "--resume")),
            "grow-from": (train_main, cli(data, tmp_path / "new", "--grow-from", str(out / "ckpt.pt")))}
    main, args = argv[cmd]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert f"error: refusing to load {out / 'ckpt.pt'}: the file is {UNREADABLE}" in capsys.readouterr().err


def test_clis_name_bad_devices_and_non_finite_weights(data, tmp_path, capsys):
    model = FractusCTE(FractusConfig.preset("tiny", vocab_size=512))
    model.save(tmp_path / "ok.pt")
    bad = {"bogus": "not a device: 'bogus'"}
    if not torch.cuda.is_available():
        bad["cuda"] = "'cuda' is not available"
    for main, args in ((evaluate_main, ["--data", str(data)]), (sample_main, ["--tokens", "2"])):
        for device, msg in bad.items():  # not "damaged, truncated or not a checkpoint"
            with pytest.raises(SystemExit) as e:
                main([str(tmp_path / "ok.pt"), *args, "--device", device])
            assert e.value.code == 2 and f"argument --device: {msg}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "ok.pt"), "--temperature", "inf"])
    assert e.value.code == 2 and "must be finite and ≥ 0, got inf" in capsys.readouterr().err
    with torch.no_grad():  # finite weights whose logits overflow: the final norm's scale near fp32's max
        model.ln_f.weight.fill_(3e38)
    model.save(tmp_path / "huge.pt")
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "huge.pt"), "--prompt", "To be", "--tokens", "2"])
    assert e.value.code == 2 and "next-token probabilities are not finite" in capsys.readouterr().err
    with torch.no_grad():
        model.embed.weight.fill_(float("nan"))
    model.save(tmp_path / "nan.pt")
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "nan.pt"), "--prompt", "To be", "--tokens", "2"])
    assert e.value.code == 2 and "holds non-finite values (NaN or inf)" in capsys.readouterr().err
    table = tmp_path / "eval.csv"
    with pytest.raises(SystemExit) as e:
        evaluate_main([str(tmp_path / "nan.pt"), "--data", str(data), "--chunk-len", "16", "--tokens", "64", "--csv", str(table)])
    assert e.value.code == 2 and "gives a non-finite CE (nan)" in capsys.readouterr().err
    assert not table.exists(), "nothing written"


@pytest.mark.parametrize("payload", [{"config": 5, "model": {}}, {"config": {}, "model": [1]},
                                     {"config": {}, "model": {"embed.weight": 1.0}}, {"config": {1: 2}, "model": {}}])
def test_clis_exit_2_on_checkpoints_of_another_structure(data, tmp_path, capsys, payload):
    torch.save(payload, tmp_path / "odd.pt")  # a safe zip archive, but not what Fractus writes
    for main, args in ((sample_main, ["--tokens", "2"]), (evaluate_main, ["--data", str(data)]),
                       (train_main, cli(data, tmp_path / "new", "--grow-from", str(tmp_path / "odd.pt")))):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "odd.pt"), *args] if main is not train_main else args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error:") and "Traceback" not in err, err


def test_a_triton_trained_checkpoint_samples_and_evaluates_on_the_cpu(data, tmp_path, capsys, monkeypatch):
    FractusCTE(FractusConfig.preset("tiny", vocab_size=512, backend="triton")).save(tmp_path / "gpu.pt")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU machine without Triton's interpreter
    sample_main([str(tmp_path / "gpu.pt"), "--prompt", "To be", "--tokens", "2"])
    evaluate_main([str(tmp_path / "gpu.pt"), "--data", str(data), "--chunk-len", "16", "--tokens", "64"])
    assert "CE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "gpu.pt"), "--prompt", "To be", "--tokens", "2", "--backend", "triton"])
    assert e.value.code == 2 and "needs Triton's interpreter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        train_main(cli(data, tmp_path / "run", "--backend", "triton"))
    assert e.value.code == 2 and "needs Triton's interpreter" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "refused before anything is written"


def test_growing_a_non_finite_checkpoint_is_refused(data, tmp_path, capsys):
    model = FractusCTE(FractusConfig.preset("tiny", vocab_size=512))
    with torch.no_grad():
        model.embed.weight[0, 0] = float("nan")
    model.save(tmp_path / "nan.pt")
    with pytest.raises(SystemExit) as e:
        train_main(cli(data, tmp_path / "run", "--grow-from", str(tmp_path / "nan.pt")))
    assert e.value.code == 2 and "nan.pt holds non-finite values (NaN or inf)" in capsys.readouterr().err


def test_evaluate_refuses_a_csv_it_cannot_add_to_before_evaluating(data, tmp_path, capsys):
    foreign = tmp_path / "metrics.csv"
    foreign.write_text("step,tokens,lr\n1,128,0.1\n")  # a trainer's
    (tmp_path / "b.csv").write_bytes(bytes(range(256)))
    (tmp_path / "f.txt").write_text("a file, not a folder\n")
    for path, msg in ((foreign, "metrics.csv is not a CSV of the columns checkpoint, data, split"),
                      (tmp_path / "b.csv", "b.csv is not a CSV file"),
                      (tmp_path / "f.txt" / "x.csv", "its folder cannot be created or written")):
        with pytest.raises(SystemExit) as e:  # the checkpoint is not even looked at
            evaluate_main([str(tmp_path / "none.pt"), "--data", str(data), "--csv", str(path)])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert foreign.read_text() == "step,tokens,lr\n1,128,0.1\n"


def test_a_checkpoint_of_an_odd_kind_or_integer_weights_is_refused(data, tmp_path, capsys):
    """An ``arch`` that is a list (not a name), and weights cast to int64 (which would load, cast
    back, and evaluate to a wrong CE): each an error naming the file, from sample and evaluate."""
    model = FractusCTE(FractusConfig.preset("tiny", vocab_size=512))
    good = {"arch": "cte", "config": model.cfg.to_dict(), "model": model.state_dict()}
    cases = {"list.pt": ({**good, "arch": ["cte"]}, "unknown model kind"),
             "int.pt": ({**good, "model": {k: v.long() for k, v in good["model"].items()}}, "type mismatches")}
    for name, (payload, msg) in cases.items():
        torch.save(payload, tmp_path / name)
        for main, args in ((sample_main, ["--tokens", "2"]), (evaluate_main, ["--data", str(data)])):
            with pytest.raises(SystemExit) as e:
                main([str(tmp_path / name), *args])
            err = capsys.readouterr().err
            assert e.value.code == 2 and msg in err and str(tmp_path / name) in err, err
