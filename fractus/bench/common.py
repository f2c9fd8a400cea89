"""The smoke switch (``SMOKE``: ``FRACTUS_SMOKE=1``), and the timing, peak-memory and CPU-ceiling
helpers shared by every benchmark (their rows' provenance and CSVs: :mod:`fractus.training.records`). The correctness-check
helpers are :mod:`fractus.verify.checks`' (the checks made without the benchmarks use them too),
imported here under the names the benchmarks and notebooks use."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from fractus.verify.checks import check_rows, dtype_name, error_row, rel_err  # noqa: F401

SMOKE = os.environ.get("FRACTUS_SMOKE", "0") == "1"


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued kernels (a no-op on CPU), so that wall times measure them."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def call_times(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> list[float]:
    """Wall times in seconds of ``reps`` calls of ``fn()``, after ``warmup`` calls (CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], object], warmup: int = 2, reps: int = 5,
                device: torch.device | str = "cpu") -> float:
    """Median wall time of ``fn()`` in seconds: ``warmup`` calls, then the median of ``reps`` on
    CPU (:func:`call_times`); on CUDA ``triton.testing.do_bench``'s median (its own 25 ms warm-up
    and 100 ms of reps)."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench  # triton is loaded only where a CUDA timing needs it
        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return statistics.median(call_times(fn, warmup, reps))


def interleaved_times(fns: list[Callable[[], object]], rounds: int, warmup: int = 1) -> list[list[float]]:
    """Wall times in seconds of each of ``fns`` over ``rounds`` rounds, every fn once per round in
    turn (after ``warmup`` calls each), so that a drift of the shared machine's speed reaches all of
    them alike: ``out[i]`` is ``fns[i]``'s times."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return times


def cpu_ceilings(n: int = 1024, copy_mib: int = 64) -> dict[str, float]:
    """This CPU's measured ceilings with the current torch threads: fp32 matmul FLOP/s (n×n),
    copy bandwidth (bytes read + written per second) and the wall time of one tiny op (the
    per-op dispatch cost of eager PyTorch)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t_mm = median_time(lambda: a @ b, warmup=2, reps=7)
    src = torch.empty(copy_mib << 18)  # fp32 elements
    dst = torch.empty_like(src)
    t_cp = median_time(lambda: dst.copy_(src), warmup=2, reps=7)
    x, y = torch.ones(4), torch.ones(4)
    reps = 2000
    t_op = median_time(lambda: [torch.add(x, y) for _ in range(reps)], warmup=1, reps=5) / reps
    return {"matmul_flops": 2 * n ** 3 / t_mm, "copy_bytes_s": 2 * src.numel() * 4 / t_cp, "op_s": t_op}


def _high_water_rss() -> int:
    """This process's peak resident set (VmHWM) in bytes; unlike ru_maxrss it starts afresh
    in a spawned child instead of inheriting the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status (Linux only)")


def _resolve(target: str):
    """``"module:function"`` → the function."""
    mod, name = target.split(":")
    return getattr(importlib.import_module(mod), name)


def _peak_child(target: str, kwargs: dict) -> int:
    thunk = _resolve(target)(**kwargs)
    base = _high_water_rss()
    thunk()
    return _high_water_rss() - base


def _fresh_child(target: str, kwargs: dict):
    from fractus.allocator import keep_freed_memory
    keep_freed_memory()
    return _resolve(target)(**kwargs)


def _child(child, target: str, kwargs: dict, q) -> None:
    try:
        q.put(("ok", child(target, kwargs)))
    except Exception as e:  # the parent re-raises it with the child's message
        q.put(("error", f"{type(e).__name__}: {e}"))


def _spawned(child, target: str, kwargs: dict):
    """``child(target, kwargs)`` in a new Python process (spawned: nothing inherited)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(child, target, kwargs, q))
    p.start()
    status, out = q.get(timeout=3600)
    p.join()
    if status != "ok":
        raise RuntimeError(f"{target} failed in its process: {out}")
    return out


def cpu_peak_bytes(target: str, **kwargs) -> int:
    """Peak extra resident memory of one call on CPU, measured in a fresh process.

    ``target`` is ``"module:function"``; ``function(**kwargs)`` allocates the inputs and
    returns a thunk; the result is the rise of the process's high-water RSS during the thunk.
    """
    return int(_spawned(_peak_child, target, kwargs))


def in_fresh_process(target: str, **kwargs):
    """``module:function(**kwargs)`` run in a new Python process and its (picklable) result.

    As a training run would: nothing left by earlier measurements (a big model's freed heap
    slows a small model's many small allocations by up to 25 % on the 2-core machine) and
    glibc's thresholds set as the trainer sets them (:mod:`fractus.allocator`)."""
    return _spawned(_fresh_child, target, kwargs)


def cuda_peak_bytes(fn: Callable[[], object], leaves=()) -> int:
    """Peak CUDA memory allocated during ``fn()`` above what was allocated before it; the
    ``leaves``' gradients (of an earlier call) are freed first, so that ``fn`` is measured from
    where its first call started."""
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cuda_context_lost(device: torch.device | str) -> bool:
    """Whether CUDA's context is unusable: an illegal address or a device-side assert is sticky,
    every later CUDA call in the process fails (False off CUDA)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return False
    except Exception:  # RuntimeError or torch.AcceleratorError, depending on torch's version
        return True
