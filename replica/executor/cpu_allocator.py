"""glibc malloc tuned for a CPU engine: freed memory is kept for reuse instead of returned to the OS.

By default glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh mmap
and unmaps it on free, so each prefill step's activations (tens of MiB per layer) page-fault and get
zeroed by the kernel again. vLLM's CPU backend gets the same effect by preloading tcmalloc. With
mmap off and trimming off, the heap grows to the largest step's working set and stays there: 15-20%
faster end to end on the offline benchmark (benchmarks/results/offline.md).
"""
import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


@functools.cache
def keep_freed_memory() -> bool:
    """Set it for this process (once); False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: large CPU allocations stay mmap-backed")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
