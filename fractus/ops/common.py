"""What every op in :mod:`fractus.ops` shares: the backend choice, the kernels' output buffers and
autograd guard, and the decays per level that the recurrences read.

``"auto"`` runs Triton on CUDA tensors and the fast PyTorch path on CPU tensors.
``"triton"`` on CPU tensors runs Triton's interpreter; it needs ``TRITON_INTERPRET=1``
in the environment before :mod:`triton` is first imported (``tests/conftest.py`` sets it), and
computes bf16 and tf32 there as a GPU does (:mod:`fractus.ops.interpreter`).
``"torch"`` and ``"reference"`` force the PyTorch paths.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch

BACKENDS = ("auto", "triton", "torch", "reference")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_available(backend: str, device: torch.device | str) -> None:
    """ValueError unless ``backend`` can run on ``device``: 'triton' off CUDA needs Triton's interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and torch.device(device).type != "cuda" and not interpreting():
        raise ValueError("backend 'triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before triton is imported (tests/conftest.py does), or use 'auto' or 'torch'")


def pick(backend: str, x: torch.Tensor) -> str:
    """Resolve ``backend`` for an op whose main input is ``x``; returns 'triton', 'torch' or 'reference'."""
    check_available(backend, x.device)
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend == "triton" and not x.is_cuda:
        from fractus.ops import interpreter  # imports Triton's interpreter: only when it runs
        interpreter.install()
    return backend


def sequential_configs():
    """Autotune configs of the chunk-loop kernels (one program per head looping over its chunks):
    4 or 8 warps, 1 or 2 stages; a single one in the interpreter."""
    import triton  # only where kernels are defined
    if interpreting():
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2)]


def dot_precision(x: torch.Tensor) -> str:
    """``tl.dot``'s input_precision for inputs like x: IEEE for fp32 (TF32 would cost ~1e-3
    relative error), "tf32" otherwise (fp16/bf16 dots ignore it)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


_POISON = False


@contextmanager
def poisoned(on: bool = True):
    """Inside the block :func:`empty` fills new buffers with NaN, so that elements a kernel leaves
    unwritten fail the checks (the tests, the GPU suite's correctness stages); ``on=False`` leaves
    them untouched (the address checks' buffers past 2³¹ elements, whose pages must stay unused)."""
    global _POISON
    before, _POISON = _POISON, on
    try:
        yield
    finally:
        _POISON = before


def empty(*shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled while poisoning is on."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    if _POISON and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def first_order_only(backward):
    """Decorate a hand-written autograd backward: with ``create_graph=True`` (grad mode on inside
    the backward) raise, instead of returning gradients that a second derivative would treat as
    constants (``once_differentiable`` misses that case when the incoming gradient is constant)."""
    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{type(ctx).__name__}: second derivatives (create_graph=True) are not supported "
                               "by this kernel's hand-written backward; use backend='reference'")
        return backward(ctx, *grads)
    return checked


def level_decays(decay, B: int, T: int, Lv: int, H: int, dtype, device) -> torch.Tensor:
    """γ per position as [B or 1, T or 1, Lv, H]: ones for None, an [H] decay repeated for every
    level, a fixed decay the same at every position."""
    if decay is None:
        return torch.ones(1, 1, Lv, H, dtype=dtype, device=device)
    if decay.dim() <= 2:
        return decay.to(dtype).expand(Lv, H).view(1, 1, Lv, H)
    return decay.to(dtype).view(B, T, -1, H).expand(B, T, Lv, H)
