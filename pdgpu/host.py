"""The engine's host process: glibc's allocator told to keep freed memory.

By default glibc hands large freed blocks back to the OS at once (mmap'ed blocks are
unmapped, the top of the heap is trimmed), so every prefill chunk's attention buffers
page-fault afresh until its dynamic thresholds adapt: the first engine of a process measured
~20% slower on CPU. A serving process keeps its memory; `keep_freed_memory` says so through
`mallopt`, once, where glibc is the C library (elsewhere it does nothing).
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB free at the top of the heap
MMAP_THRESHOLD = 32 << 20  # below it, from the kept heap (256 MiB measured no better)

@functools.cache  # the setting is process-wide: once is enough
def keep_freed_memory() -> dict:
    """Set glibc's trim and mmap thresholds (once per process); {name: accepted} or {}."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return {"trim_threshold": bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)),
            "mmap_threshold": bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))}
