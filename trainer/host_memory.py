"""The process's host memory: what it holds (read into every step's metrics) and how the C allocator is
told to give freed memory back.

A training process allocates tensors of ever-changing sizes (micro-batches padded to their longest
row, a KV cache that grows). glibc's malloc serves blocks under its mmap threshold from heaps it
rarely returns, and it raises that threshold to the size of every large block freed (up to 32 MiB),
so after a few steps nearly every tensor lives in a heap whose free holes cannot be reused by the
next, larger one: a real model's run grew by gigabytes a step until the kernel killed it (issue 28).
`bound_heap_growth` fixes the threshold, so that large blocks are mapped and unmapped on their own,
and `return_free_heap` hands the heaps' free tails back after each step. Both do nothing where the
C library is not glibc.

    bound_heap_growth()           # once, before the model loads
    ...
    return_free_heap()            # after each step
    rss_gb(), peak_rss_gb(), free_heap_gb()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from functools import cache

MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks this large or larger are mapped on their own and unmapped when freed: the cost is a page
fault per fresh page, small beside the work on a tensor of a mebibyte or more."""
_M_MMAP_THRESHOLD = -3
"""`mallopt`'s parameter number for the mmap threshold (glibc's malloc.h)."""


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later): sizes in bytes."""

    _fields_ = [
        ("arena", ctypes.c_size_t),
        ("ordblks", ctypes.c_size_t),
        ("smblks", ctypes.c_size_t),
        ("hblks", ctypes.c_size_t),
        ("hblkhd", ctypes.c_size_t),
        ("usmblks", ctypes.c_size_t),
        ("fsmblks", ctypes.c_size_t),
        ("uordblks", ctypes.c_size_t),
        ("fordblks", ctypes.c_size_t),
        ("keepcost", ctypes.c_size_t),
    ]


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None under another C library (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def bound_heap_growth(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (which also stops it from rising); True if set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1)


def return_free_heap() -> None:
    """Give the heaps' free memory back to the kernel (glibc's `malloc_trim(0)`)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def free_heap_gb() -> float:
    """GiB that glibc's heaps hold free (resident or not): fragmentation that RSS alone hides; 0.0
    without glibc 2.33 or later."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0.0
    libc.mallinfo2.restype = _MallInfo2
    return float(libc.mallinfo2().fordblks) / 2**30


def peak_rss_gb() -> float:
    """The largest resident memory this process has held so far, in GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gb() -> float:
    """This process's resident memory now, in GiB (Linux's /proc/self/statm; 0.0 where it is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
