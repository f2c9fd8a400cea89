"""glibc malloc settings for CPU training: keep freed big blocks for the next step.

PyTorch's CPU tensors come from malloc. glibc serves blocks above its mmap threshold with fresh
mmap'd pages and hands freed heap memory back to the kernel above its trim threshold; either way
the next step's tensors of that size page-fault anew and the kernel zeroes every page. A training
step allocates the same sizes every time (the cross-entropy chunk, the [V, d] head gradient, the
attention chunk states), so on this project's 2-core machine the faults cost 5–10 % of a palier0
step and made long sequences superlinear in T. Raising both thresholds keeps those blocks in the
heap. It is what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (or tcmalloc/jemalloc
via ``LD_PRELOAD``) do, applied from Python by the trainer and the benchmarks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit; bigger blocks are still mmap'd
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when applied (Linux/glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
