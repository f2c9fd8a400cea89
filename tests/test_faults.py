"""Faults a user meets: a full disk, Ctrl-C, a closed pipe, concurrent writers, ambiguous or odd
inputs. Every command answers with one ``error:`` line (exit 2), ``interrupted`` (exit 130) or a
quiet exit (141, a closed pipe), never a traceback, and loses nothing it had written."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch

from fractus import bench, data, evaluate, merge, sample
from fractus.training import records
from fractus.bench import __main__ as bench_main
from fractus.checkpoint import load_checkpoint
from fractus.cli import run_command
from fractus.model import FractusConfig, FractusCTE
from fractus.training.command import main, train
from util import ROOT, cli, make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """A finished tiny run (ckpt.pt, metrics.csv)."""
    out = tmp_path_factory.mktemp("run") / "run"
    train(cli(corpus, out, tokens=10 * 32))
    return out


def exits(capsys, fn, *args, code=2):
    """``fn(*args)``'s exit code is ``code``; its stderr, with no traceback."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    return err


# -- a full disk ----------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only; skipped where it cannot be mounted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def fill(folder, leave: int = 8192):
    """Fill ``folder``'s filesystem but ``leave`` bytes; returns the filler's path."""
    st = os.statvfs(folder)
    filler = folder / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_full_disk_names_the_file_keeps_the_last_checkpoint_and_resumes(corpus, small_disk, capsys):
    out = small_disk / "run"
    argv = cli(corpus, out, "--ckpt-every", "5", tokens=20 * 32)
    main([*argv, "--stop-after", "5"])
    before = load_checkpoint(out / "ckpt.pt")
    filler = fill(small_disk)
    err = exits(capsys, main, [*argv, "--resume"])
    assert f"error: cannot write {out / 'ckpt.pt'}: No space left on device" in err
    assert load_checkpoint(out / "ckpt.pt")["step"] == before["step"] == 5
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    filler.unlink()
    main([*argv, "--resume"])
    assert load_checkpoint(out / "ckpt.pt")["step"] == 20


def test_merge_onto_a_full_disk(run, small_disk, capsys):
    fill(small_disk)
    err = exits(capsys, merge.main, [str(run / "ckpt.pt"), str(run / "ckpt.pt"), "-o", str(small_disk / "m.pt")])
    assert f"error: cannot write {small_disk / 'm.pt'}: No space left on device" in err


def test_an_error_underneath_a_library_s_own_is_named():
    """torch.save on a full disk raises its own RuntimeError while handling the OSError: the write
    is reported as the OSError, naming the file."""
    from fractus.atomic import atomic_open, underlying_os_error
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")
    except RuntimeError as e:
        wrapped = e
    assert underlying_os_error(wrapped).errno == 28 and underlying_os_error(KeyboardInterrupt()) is None
    with pytest.raises(OSError, match="cannot write .*x.bin: No space left on device"):
        with atomic_open(ROOT / "results" / "x.bin", "wb"):
            raise wrapped
    assert not (ROOT / "results" / "x.bin").exists()


# -- Ctrl-C and closed pipes: one discipline for every command ----------------------------------
def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("module, target, argv", [
    (data, "prepare", ["prepare", "--input", "x", "--out", "y"]),
    (evaluate, "evaluate_checkpoint", ["c.pt", "--data", "d"]),
    (sample, "load_model", ["c.pt"]),
    (merge, "merge", ["a.pt", "b.pt", "-o", "m.pt"]),
    (records, "run_rows", ["run", "--out", "r.csv"]),
])
def test_ctrl_c_in_any_command_exits_130_without_a_traceback(module, target, argv, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, target, interrupt)
    assert "interrupted" in exits(capsys, module.main, argv, code=130)


def test_sample_into_a_closed_pipe_is_quiet(run):
    """``python -m fractus.sample CKPT | head -1``: head closes the pipe; sample stops quietly."""
    cmd = (f"{sys.executable} -m fractus.sample {run / 'ckpt.pt'} --tokens 20 --num-samples 200 | head -1; "
           "echo \"exit ${PIPESTATUS[0]}\"")
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.stdout.startswith("--- ") and r.stdout.strip().endswith("exit 141"), r.stdout
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_sigint_during_sampling_exits_130(run):
    # the child starts with Ctrl-C's default action, as from a terminal: a process started with
    # SIGINT ignored (a disposition the test runner's worker may pass on) keeps ignoring it
    p = subprocess.Popen([sys.executable, "-m", "fractus.sample", str(run / "ckpt.pt"), "--tokens", "20",
                          "--num-samples", "10000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.readline().startswith("--- ")  # work has started
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err


def test_run_command_maps_each_fault():
    from fractus.cli import CommandError

    def raising(e):
        def body():
            raise e
        return body
    for e, code in ((ValueError("v"), 2), (OSError(28, "full"), 2), (CommandError("c"), 2),
                    (KeyboardInterrupt(), 130)):
        with pytest.raises(SystemExit) as ex:
            run_command(raising(e))
        assert ex.value.code == code
    with pytest.raises(RuntimeError):  # a bug is not an input error: its traceback stays
        run_command(raising(RuntimeError("bug")))


# -- the model's state, the benchmarks, the records ---------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "original-tiny"])
def test_a_state_of_another_batch_size_is_refused(preset):
    model = FractusCTE(FractusConfig.preset(preset))
    _, _, state = model(torch.zeros(2, 5, dtype=torch.long))
    for call in (lambda: model(torch.zeros(3, 5, dtype=torch.long), state),
                 lambda: model.step(torch.zeros(1, dtype=torch.long), state)):
        with pytest.raises(ValueError, match=r"the state was made for 2 stream\(s\), the input has"):
            call()
    with pytest.raises(ValueError, match="block 0's state must be"):
        model(torch.zeros(2, 5, dtype=torch.long), [s[:1] for s in state])


def test_bench_refuses_before_measuring(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep")
    for argv in (["cpu", "--out", str(f)], ["gpu", "--dry-run", "--out", str(f)]):
        assert "is a file: give the folder" in exits(capsys, bench_main.main, argv)
    assert f.read_text() == "keep"
    if not torch.cuda.is_available():
        assert "error: the GPU suite needs a CUDA device" in exits(capsys, bench_main.main,
                                                                  ["gpu", "--out", str(tmp_path / "g")])
    assert bench  # the package, imported for its __main__


def test_records_refuses_to_overwrite_the_run_s_own_files(run, capsys):
    for name in ("ckpt.pt", "metrics.csv"):
        before = (run / name).read_bytes()
        err = exits(capsys, records.main, [str(run), "--out", str(run / name), "--force"])
        assert f"it is the run's own {name}" in err and (run / name).read_bytes() == before


def _append_rows(path, worker):
    from fractus.training.records import append_csv
    for i in range(20):
        append_csv(path, {"worker": worker, "i": i})


def test_concurrent_appends_keep_every_row(tmp_path):
    path = tmp_path / "r.csv"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_rows, args=(path, w)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    rows = pd.read_csv(path)
    assert len(rows) == 120 and sorted(zip(rows["worker"], rows["i"])) == [(w, i) for w in range(6) for i in range(20)]


# -- inputs that mean something else than they seem ----------------------------------------------
def test_the_built_in_corpus_name_is_refused_when_a_path_has_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "mine.txt").write_text("my own text\n" * 50)
    err = exits(capsys, data.main, ["prepare", "--input", "shakespeare", "--out", "d"])
    assert "names the built-in corpus (38 plays), but ./shakespeare exists too" in err
    assert not (tmp_path / "d" / "meta.json").exists()
    assert "neither a regular file nor a directory" in exits(capsys, data.main,
                                                             ["prepare", "--input", "/dev/zero", "--out", "d"])


def test_seeds_and_token_counts_that_cannot_make_a_run(corpus, run, tmp_path, capsys):
    assert "must be in [0, 4294967295]" in exits(capsys, main, cli(corpus, tmp_path / "r", "--seed",
                                                                   "99999999999999", "--active-blocks", "1"))
    err = exits(capsys, main, [*cli(corpus, run, tokens=5 * 32), "--resume"])
    assert "makes 5 steps, but" in err and "is already at step 10" in err


@pytest.mark.parametrize("command", ["fractus.train", "fractus.data prepare", "fractus.evaluate", "fractus.sample",
                                     "fractus.merge", "fractus.training.records", "fractus.vision train", "fractus.bench gpu",
                                     "fractus.experiments.compare sweep", "fractus.experiments.growth search"])
def test_every_command_prints_its_help(command):
    """``--help`` prints the usage and exits 0: argparse formats each help text with %, so a bare
    "5 % of" in one would be a traceback instead."""
    r = subprocess.run([sys.executable, "-m", *command.split(), "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and not r.stderr, r.stderr[-2000:]
