"""What several test modules share: the error asserts (on :func:`fractus.bench.common.rel_err`), a
kernel-launch recorder, an autotune pin, random MoE experts, and a toy corpus with the trainer's
arguments for short runs on it, and the trainer's command line in a process of its own. Test
modules share through this module (and conftest.py's fixtures) only: they never import each other."""
import csv
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fractus.bench.common import rel_err
from fractus.data import prepare, write_toy_corpus

ROOT = Path(__file__).resolve().parents[1]  # the checkout


class Launches:
    """Stands in for a Triton kernel: records each launch's keyword arguments (the constexprs),
    then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.kwargs = kernel, []

    @property
    def count(self) -> int:
        return len(self.kwargs)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)
        return record


@contextmanager
def pinned(kernel, config):
    """Launch the autotuned ``kernel`` (Triton's ``Autotuner``) with ``config`` only: with one
    config it does not tune. Tests use it to run the GPU's configs in the interpreter."""
    configs, cache = kernel.configs, kernel.cache
    kernel.configs, kernel.cache = [config], {}
    try:
        yield
    finally:
        kernel.configs, kernel.cache = configs, cache


def assert_rel(x: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    e = rel_err(x, ref)
    assert e < tol, f"{what}: relative error {e:.3e} >= {tol:.1e}"


LOWP = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]  # tested low precisions


def lowp_tol(tol: float, dtype: torch.dtype) -> float:
    """A tolerance given for fp16, in dtype: bf16's is 8x (its unit roundoff 2⁻⁸ against fp16's
    2⁻¹¹; the kernels' measured excess errors are 7-10x fp16's)."""
    return tol * (8 if dtype == torch.bfloat16 else 1)


def assert_lowp(x: torch.Tensor, same_dtype_ref: torch.Tensor, truth: torch.Tensor,
                tol: float = 1e-3, what: str = "") -> None:
    """Low precision rule: err(x vs fp32 truth) <= err(same-dtype PyTorch ref vs truth) + tol."""
    e, e_ref = rel_err(x, truth), rel_err(same_dtype_ref, truth)
    assert e <= e_ref + tol, f"{what}: error {e:.3e} > same-dtype reference {e_ref:.3e} + {tol:.0e}"


MOE_D, MOE_FF = 48, 80  # the MoE tests' widths: not multiples of the kernels' blocks


def make_experts(E, d=MOE_D, F=MOE_FF, r=16, lowrank=True, dtype=torch.float32):
    """Random experts of either kind, as leaf tensors that require grad."""
    if lowrank:
        ex = dict(V1=torch.randn(E, d, r) / d ** 0.5, U1=torch.randn(E, F, r) / r ** 0.5,
                  b1=0.1 * torch.randn(E, F), s1=0.5 + torch.rand(E),
                  V2=torch.randn(E, F, r) / F ** 0.5, U2=torch.randn(E, d, r) / r ** 0.5,
                  b2=0.1 * torch.randn(E, d), s2=0.5 + torch.rand(E))
    else:
        ex = dict(W1=torch.randn(E, d, F) / d ** 0.5, b1=0.1 * torch.randn(E, F),
                  W2=torch.randn(E, F, d) / F ** 0.5, b2=0.1 * torch.randn(E, d))
    return {k: v.to(dtype).requires_grad_() for k, v in ex.items()}


STEPS = 80  # optimizer steps of the trainer tests' reference run (2 streams × 16 tokens each)
SAME = ("step", "tokens", "lr", "train_ce", "train_lb", "grad_norm", "val_ce", "val_bpb", "val_ppl")


def make_corpus(root: Path) -> Path:
    """A small deterministic text, prepared with vocab 512 into root/data."""
    prepare(str(write_toy_corpus(root / "corpus.txt")), root / "data", vocab_size=512)
    return root / "data"


def cli(data, out, *extra, tokens=STEPS * 32) -> list[str]:
    """The trainer's arguments for a short run of the tiny preset on ``data`` (one thread, no bar)."""
    return ["--preset", "tiny", "--data", str(data), "--out", str(out), "--tokens", str(tokens),
            "--batch-size", "2", "--chunk-len", "16", "--accum", "1", "--threads", "1",
            "--eval-every", "10", "--eval-tokens", "128", "--ckpt-every", "5", "--sample-tokens", "0",
            "--no-progress", *extra]


def metrics(out: Path) -> list[dict]:
    """The columns :data:`SAME` of each row of ``out/metrics.csv``."""
    with open(out / "metrics.csv", newline="") as f:
        return [{k: r[k] for k in SAME} for r in csv.DictReader(f)]


def popen(argv, script=None) -> subprocess.Popen:
    """``python -m fractus.train ARGV`` (or ``python -c SCRIPT ARGV``) in a process of its own, from
    the checkout, its output captured as text."""
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
