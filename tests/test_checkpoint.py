"""Checkpoint files: damaged bytes are caught by the zip CRCs, unreadable files and directories get
clear errors (exit code 2 from the CLIs), and the file mode follows the umask."""
import os
import zipfile

import pytest
import torch

from fractus.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fractus.evaluate import main as evaluate_main
from fractus.model import FractusConfig, FractusCTE
from fractus.train import main as train_main
from test_train import cli, make_corpus

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
    bad.write_bytes(data[:offset + 10] + b"\0" * 8 + data[offset + 18:])  # was "could run code"
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
    with pytest.raises(CheckpointError, match="refusing to load .* could run code"):
        load_checkpoint(tmp_path / "evil.pt")


def test_directories_are_named_so(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*: it is a directory"):
        save_checkpoint(tmp_path, {"config": {}, "model": {}})
    assert list(tmp_path.iterdir()) == [], "nothing written"


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
    assert f"error: cannot read checkpoint {out / 'ckpt.pt'}: the file is {UNREADABLE}" in capsys.readouterr().err
