"""glibc's malloc pinned for a streaming run (``ckpt convert`` and its workers): freed buffers go back to the OS.

A conversion allocates and frees the same few MiB-sized buffers thousands of times while the target builds up
long-lived small objects.  glibc's defaults adapt against that: its mmap threshold rises to the largest block
freed (up to 32 MiB), so piece buffers come from the heap, where long-lived small allocations between them keep
the heap from shrinking, and each thread's arena keeps its own free space.  Measured (bench/bench_memory.py,
ckpt -> NxD, default malloc): peak anonymous memory grew with the model (161 MiB at 0.89 GiB, 255 MiB at 1.95 GiB,
2.4 GiB at 26 GiB) while what the conversion holds stayed at ~56 MiB.  Pinning the thresholds (as
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` would) makes every buffer of 128 KiB
or more its own mapping, returned when freed.  Done by the CLI only: a library caller's process keeps its own
allocator settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
THRESHOLD = 128 << 10


def pin_malloc() -> bool:
    """Pin glibc's mmap and trim thresholds (128 KiB) and cap its arenas at 2; False where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(
        mallopt(param, value) == 1
        for param, value in ((M_MMAP_THRESHOLD, THRESHOLD), (M_TRIM_THRESHOLD, THRESHOLD), (M_ARENA_MAX, 2))
    )


__all__ = ["pin_malloc"]
