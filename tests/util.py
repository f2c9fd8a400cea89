"""The tests' error asserts (on :func:`fractus.bench.common.rel_err`), a kernel-launch recorder and an
autotune pin."""
from contextlib import contextmanager

import pytest
import torch

from fractus.bench.common import rel_err


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
