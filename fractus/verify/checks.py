"""How a kernel's outputs are judged against their truth: the relative error, the correctness
table's rows (fp32 within 1e-4; low precision no worse than the same-dtype PyTorch path plus a
margin) and a failed check's row. The GPU suite's stages, the checks past 2³¹ elements and the
tests use them."""
from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """How the CSVs name a dtype: 'float32', 'bfloat16', …"""
    return str(dtype).removeprefix("torch.")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in fp64 (inf if x has a non-finite value); the tests' measure too."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_rows(kernel: str, dtype: torch.dtype, names, got, truth, same=None, margin: float = 0.0,
               margins: dict | None = None, truth_name: str = "fp32 reference") -> list[dict]:
    """Correctness-table rows for one kernel call, one per output. fp32 (``same`` None):
    rel_err vs the truth < 1e-4. Low precision: rel_err ≤ that of the same-dtype PyTorch path
    + ``margin`` (``margins[name]`` where given)."""
    rows = []
    for name, g, t, s in zip(names, got, truth, same if same is not None else [None] * len(got)):
        e = rel_err(g, t)
        if s is None:
            tol, check = 1e-4, f"{name} vs {truth_name}"
        else:
            tol = rel_err(s, t) + (margins or {}).get(name, margin)
            check = f"{name} vs {truth_name} (<= same-dtype torch path err + margin)"
        rows.append(dict(kernel=kernel, dtype=dtype_name(dtype), check=check, rel_err=e,
                         tol=tol, passed=e <= tol))
    return rows


def error_row(kernel: str, dtype: torch.dtype, exc: Exception) -> dict:
    """A failed row of the correctness table: the exception recorded, not raised."""
    return dict(kernel=kernel, dtype=dtype_name(dtype),
                check=f"error: {type(exc).__name__}: {exc}"[:300], rel_err=float("nan"), tol=float("nan"),
                passed=False)
