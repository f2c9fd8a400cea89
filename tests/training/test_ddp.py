"""Several processes (2 gloo processes, torchrun on 127.0.0.1): one DDP step equals one
single-process step on the same global batch; a stop asked by one process stops all at the same
step, and the resumed run equals an uninterrupted one (each process gets its own carried state)."""
import csv
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fractus.checkpoint import load_checkpoint
from fractus.model import FractusConfig, FractusCTE
from fractus.training.command import train
from util import ROOT, SAME, make_corpus
from util import rel_err


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def ddp_args(data, out, steps: int, *extra) -> list[str]:
    """The trainer's arguments for ``steps`` steps of 2 processes × 2 streams × 16 tokens."""
    return ["--preset", "tiny", "--data", str(data), "--out", str(out), "--tokens", str(steps * 2 * 2 * 16),
            "--batch-size", "2", "--chunk-len", "16", "--sampling", "streams", "--accum", "1", "--eval-every", "0", "--sample-tokens", "0",
            "--no-progress", "--threads", "1", *extra]


def torchrun(tmp_path, *argv, ok: bool = True) -> str:
    """Run 2 processes (all of them exit with 0, or not: ``ok``), torchrun's log directories under
    ``tmp_path`` (not one left in the system's temp directory per run); their stdout and stderr."""
    r = subprocess.run([*TORCHRUN, "--log-dir", str(tmp_path / "torchrun"), *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.skipif(not dist.is_gloo_available(), reason="this torch build has no gloo backend")
@pytest.mark.parametrize("extra", [["--sampling", "windows"], ["--sampling", "streams", "--detach-kuramoto"]],
                         ids=["windows", "streams-detached"])  # detached: parameters without gradients
def test_ddp_step_equals_single_process_step(tmp_path, extra):
    data = make_corpus(tmp_path)
    # One optimizer step of 2 micro-steps over 4 windows (or streams): 2 per process, or 4 in one process.
    # SGD (its update is proportional to the gradient, unlike Adam's first step) and lb_coef = 0:
    # the load-balance term is computed from each process's own tokens, so it is not additive.
    common = ["--preset", "tiny", "--data", str(data), "--tokens", "128", "--chunk-len", "16",
              "--accum", "2", "--optimizer", "sgd", "--lr", "1.0", "--warmup", "1", "--lb-coef", "0",
              "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--threads", "1", *extra]
    log = torchrun(tmp_path, "-m", "fractus.train", *common, "--batch-size", "2", "--out", str(tmp_path / "ddp"))
    assert "2 process(es)" in log and f"global batch 2×2 {extra[1]}" in log
    train([*common, "--batch-size", "4", "--out", str(tmp_path / "one")])

    a, b = load_checkpoint(tmp_path / "ddp" / "ckpt.pt"), load_checkpoint(tmp_path / "one" / "ckpt.pt")
    assert a["step"] == b["step"] == 1
    ce = [float(metrics_rows(tmp_path / out)[0]["train_ce"]) for out in ("ddp", "one")]
    assert ce[0] == pytest.approx(ce[1], rel=1e-6), "the logged CE is every process's mean"
    val = [float(metrics_rows(tmp_path / out)[-1]["val_ce"]) for out in ("ddp", "one")]
    assert val[0] == pytest.approx(val[1], rel=1e-5), "rank 0 validates on the single process's 4 streams"
    torch.manual_seed(1337)  # the trainer's initialisation
    init = FractusCTE(FractusConfig.from_saved(a["config"])).state_dict()
    for k, v in b["model"].items():  # per tensor: fp32 sums in another order (level_logits ≈ 2e-5)
        assert rel_err(a["model"][k], v) < 1e-4, f"{k}: parameters after the step differ"
    pa, pb = (torch.cat([ck["model"][k].flatten() for k in init]) for ck in (a, b))
    assert rel_err(pa, pb) < 1e-5, "parameters after the step differ"
    p0 = torch.cat([v.flatten() for v in init.values()])
    assert (pb - p0).norm() > 0.1
    assert rel_err(pa - p0, pb - p0) < 1e-4, "the updates differ"


def metrics_rows(out, keys=None) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: r[k] for k in keys or r} for r in csv.DictReader(f)]


def patched_trainer(path, patch: str) -> str:
    """A script that runs the trainer's CLI after ``patch`` (code using ``T``: fractus.training.loop) and
    prints "rank R exits with CODE" when the CLI exits with a code."""
    path.write_text(f"import os, signal, sys\nimport fractus.training.loop as T\nfrom fractus.training.command import main\n"
                    f"{patch}\ntry:\n    main(sys.argv[1:])\n"
                    "except SystemExit as e:\n    print(f'rank {os.environ[\"RANK\"]} exits with {e.code}', flush=True)\n"
                    "    raise\n")
    return str(path)


STOP_ON_RANK_1 = """
orig, calls = T.agree, []
def agree(finite, stop, *rest):  # rank 1 alone gets a SIGINT, during its 3rd step
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        os.kill(os.getpid(), signal.SIGINT)
        stop = True
    return orig(finite, stop, *rest)
T.agree = agree
"""


@pytest.mark.skipif(not dist.is_gloo_available(), reason="this torch build has no gloo backend")
def test_ddp_stop_and_resume_equals_uninterrupted(tmp_path):
    data = make_corpus(tmp_path)
    stop = patched_trainer(tmp_path / "stop.py", STOP_ON_RANK_1)

    full, out = tmp_path / "full", tmp_path / "run"
    torchrun(tmp_path, "-m", "fractus.train", *ddp_args(data, full, 6))
    log = torchrun(tmp_path, stop, *ddp_args(data, out, 6), ok=False)  # saved, but not finished: not 0
    assert "stopped at step 3 of 6" in log
    assert "rank 1 exits with 130" in log and "rank 0 exits with 143" in log  # its own signal; a peer's
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["step"] == 3 and len(ck["states"]) == 2
    s0, s1 = ck["states"]
    assert not torch.equal(s0[0][0], s1[0][0]), "each process carries the state of its own streams"
    torchrun(tmp_path, "-m", "fractus.train", *ddp_args(data, out, 6, "--resume"))
    assert metrics_rows(out, SAME) == metrics_rows(full, SAME)
    a, b = load_checkpoint(out / "ckpt.pt"), load_checkpoint(full / "ckpt.pt")
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k


NAN_ON_RANK_1 = """
orig, calls = T.micro_steps, []
def micro_steps(*args, **kwargs):  # rank 1 alone sees a non-finite loss, at its 2nd step
    ce, lb, state, finite = orig(*args, **kwargs)
    calls.append(1)
    return ce, lb, state, finite and not (os.environ["RANK"] == "1" and len(calls) == 2)
T.micro_steps = micro_steps
"""


@pytest.mark.skipif(not dist.is_gloo_available(), reason="this torch build has no gloo backend")
def test_ddp_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    log = torchrun(tmp_path, patched_trainer(tmp_path / "nan.py", NAN_ON_RANK_1),
                   *ddp_args(make_corpus(tmp_path), tmp_path / "run", 4))
    assert log.count("non-finite loss, step skipped (1/3 in a row)") == 2  # both ranks skip it
    ck = load_checkpoint(tmp_path / "run" / "ckpt.pt")
    assert ck["step"] == 4 and ck["counters"]["skipped"] == 1 and ck["data_position"] == 5
