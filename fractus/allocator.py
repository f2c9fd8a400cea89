"""glibc malloc settings for CPU training: keep freed big blocks for the next step.

PyTorch's CPU tensors come from malloc. glibc serves blocks above its mmap threshold with fresh
mmap'd pages and hands freed heap memory back to the kernel above its trim threshold; either way
the next step's tensors of that size page-fault anew and the kernel zeroes every page. A training
step allocates the same sizes every time (the cross-entropy chunk, the [V, d] head gradient, the
attention chunk states). On a 2-core CPU a palier0 step at vocabulary 50257 takes about 188,000
page faults (770 MB of pages zeroed by the kernel) with glibc's defaults and about one with these
settings, for 15–25 % more tokens/s, and long attention sequences cost linearly in T. Raising both
thresholds keeps those blocks in the heap. It is what the environment variables
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (or tcmalloc/jemalloc via ``LD_PRELOAD``)
do, applied from Python by the trainer and the benchmarks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed
FALLBACK = 32 << 20  # the most that glibc versions capping the mmap threshold accept


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when applied (Linux/glibc).
    The process keeps its peak heap resident instead of returning it between steps."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, THRESHOLD) or mallopt(_M_MMAP_THRESHOLD, FALLBACK)):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD))
