"""What every experiment runner shares (:mod:`fractus.experiments.runner`): a CSV that is not the
runner's is refused by name, one runner at a time on a CSV and a runs folder, a run's rows written
whole, and Ctrl-C / SIGTERM stop the running runs (saved) and start no other — exit 130 / 143,
no traceback."""
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from fractus.experiments import compare as C
from fractus.experiments import growth as G
from fractus.experiments import memory as M
from fractus.experiments import runner
from fractus.training.records import append_csv
from fractus.training.runs import RunInUse
from util import ROOT, make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_a_csv_of_other_columns_is_refused_by_name(tmp_path, capsys):
    growth_csv = tmp_path / "growth.csv"
    append_csv(growth_csv, {c: 1 for c in G.COLUMNS})
    for read in (C.read_rows, M.read_recall):
        with pytest.raises(ValueError, match=f"{growth_csv} is not a results CSV of the .*lacks the column"):
            read(growth_csv)
    compare_csv = tmp_path / "compare.csv"
    append_csv(compare_csv, {c: 1 for c in C.COLUMNS})
    with pytest.raises(ValueError, match="not a results CSV of the growth experiment: it lacks the column.*config"):
        G.read_rows(compare_csv)
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage\n\x00\x01")
    with pytest.raises(ValueError, match="is not a CSV file"):
        C.read_rows(binary)
    assert len(C.read_rows(tmp_path / "absent.csv")) == 0 and len(G.read_rows(tmp_path / "absent.csv")) == 0
    # every runner's command: one error line, exit 2, before anything trains
    for main, argv in ((C.main, ["seeds", "--data", str(tmp_path), "--csv", str(growth_csv)]),
                       (C.main, ["sweep", "--data", str(tmp_path), "--csv", str(growth_csv),
                                 "--runs", str(tmp_path / "runs")]),
                       (G.main, ["search", "--data", str(tmp_path), "--csv", str(compare_csv)]),
                       (G.main, ["sweep", "--data", str(tmp_path), "--csv", str(compare_csv),
                                 "--runs", str(tmp_path / "runs")]),
                       (M.main, ["recall", "--csv", str(growth_csv)])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and "not a results CSV" in err, err
        assert "Traceback" not in err
    assert not any(d.is_dir() for d in (tmp_path / "runs").glob("*"))  # no run started


def test_one_runner_at_a_time_on_a_csv_and_on_a_runs_folder(tmp_path, capsys):
    csv, runs = tmp_path / "r.csv", tmp_path / "runs"
    with runner.held(csv, runs):
        with pytest.raises(RunInUse, match="being written by another runner"):
            with runner.held(csv):
                pass
        with pytest.raises(RunInUse, match="choose another --runs"):
            with runner.held(tmp_path / "other.csv", runs):
                pass
        with pytest.raises(SystemExit) as e:  # a second recall grid on the CSV: refused, not run twice
            M.main(["recall", "--csv", str(csv)])
        assert e.value.code == 2 and "another runner" in capsys.readouterr().err
    with runner.held(csv, runs):  # released with the block
        pass
    assert list(tmp_path.glob("*.csv")) == []  # the lock is beside the CSV, hidden, and writes no CSV


def test_a_run_s_rows_replace_its_earlier_ones_whole(tmp_path):
    csv = tmp_path / "r.csv"
    append_csv(csv, [{"model": "a", "lr": 0.01, "eval": e, "ce": 1.0} for e in ("x", "y")], replace=("model", "lr"))
    append_csv(csv, [{"model": "b", "lr": 0.01, "eval": "x", "ce": 2.0}], replace=("model", "lr"))
    append_csv(csv, [{"model": "a", "lr": 0.01, "eval": e, "ce": 3.0} for e in ("x", "y")], replace=("model", "lr"))
    rows = pd.read_csv(csv)
    assert list(zip(rows["model"], rows["ce"])) == [("b", 2.0), ("a", 3.0), ("a", 3.0)]


# -- stopping a runner ---------------------------------------------------------------------------
DRIVER = {  # a runner as its command runs it, on tiny models that train until they are stopped
    "compare": """
        from fractus.experiments import compare as C, runner
        from fractus.experiments.architecture import Variant
        tiny = {{"default": Variant("default", "recipe", preset="tiny", chunk_len=16, batch_size=2)}}
        jobs = [("default", lr, 0, 10 ** 8) for lr in (1e-3, 2e-3, 3e-3)]
        runner.main(lambda: C.run(jobs, "{data}", "{tmp}/c.csv", "{tmp}/runs", "sweep", workers=1, models=tiny))
    """,
    "growth": """
        from fractus.experiments import growth as G, runner
        reading = ["--batch-size", "2", "--chunk-len", "16", "--accum", "1", "--preset", "tiny"]
        jobs = [G.Job("scratch", "scratch", "tiny:100M", lr, 0) for lr in (1e-3, 2e-3)]
        runner.main(lambda: G.run(jobs, "{data}", "{tmp}/g.csv", "{tmp}/runs", eval_every=10 ** 6, threads=1,
                                  reading=reading))
    """,
    "memory": """
        from fractus.experiments import memory as M, runner
        kw = dict(d_model=32, steps=10 ** 7, vocab=32, batch=8, mix=((12, 2),), tests=((12, 2),), curve_points=2)
        jobs = [("default", 3e-3, 0), ("default", 1e-3, 0)]
        runner.main(lambda: M.run_recall(jobs, "{tmp}/m.csv", workers=1, **kw))
    """,
}


def started(tmp, which) -> bool:
    """Whether the runner's first run is training (its metrics.csv written)."""
    return any((tmp / "runs").glob("*/metrics.csv")) or any((tmp / "runs").glob("*/*/metrics.csv"))


@pytest.mark.parametrize("which, sig, code", [("compare", signal.SIGINT, 130), ("compare", signal.SIGTERM, 143),
                                              ("growth", signal.SIGINT, 130), ("memory", signal.SIGINT, 130)])
def test_a_stopped_runner_saves_its_running_run_and_starts_no_other(tmp_path, corpus, which, sig, code):
    script = textwrap.dedent(DRIVER[which]).format(data=corpus, tmp=tmp_path)
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if which == "memory":  # no run folder: time to spawn a worker, import torch and train
            time.sleep(15)
            break
        if started(tmp_path, which):
            time.sleep(1)
            break
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()
    p.send_signal(sig)  # to the runner alone, as `kill` does: it stops its workers itself
    _, err = p.communicate(timeout=120)
    assert p.returncode == code and "interrupted" in err and "Traceback" not in err, err
    time.sleep(1)
    if which == "memory":
        assert not (tmp_path / "m.csv").exists()  # no run finished: nothing written
        return
    dirs = sorted(d for d in (tmp_path / "runs").iterdir() if d.is_dir())
    assert len(dirs) == 1, dirs  # the second run never started
    saved = [dirs[0] / "ckpt.pt"] if which == "compare" else list(dirs[0].glob("*/ckpt.pt"))  # a stage's folder
    assert len(saved) == 1 and saved[0].exists()  # the stopped run saved where it was: the rerun resumes it


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, corpus):
    from fractus.experiments.architecture import STEP_TOKENS, Variant
    tiny = {"default": Variant("default", "recipe", preset="tiny", chunk_len=16, batch_size=2)}
    runs, tokens = tmp_path / "runs", 2 * STEP_TOKENS
    out = C.run_dir(runs, "default", 1e-3, 0, tokens)
    out.mkdir(parents=True)
    (out / "metrics.csv").write_text("step,loss\n1,5.0\n")  # killed before its first checkpoint
    rows = C.run([("default", 1e-3, 0, tokens)], corpus, tmp_path / "c.csv", runs, "sweep", workers=1,
                 log=lambda *_: None, models=tiny)
    assert len(rows) == 1 and rows["tokens"].iloc[0] == tokens and (out / "ckpt.pt").exists()


def test_a_job_s_failure_stops_the_others(tmp_path):
    with pytest.raises(ValueError, match="math domain error"):
        with runner.Workers(1) as pool:
            import math
            pool.submit("bad", math.sqrt, -1.0)
            pool.submit("late", time.sleep, 60)
            t0 = time.time()
            list(pool.done())
    assert time.time() - t0 < 30  # the queued job was cancelled or interrupted, not waited for
