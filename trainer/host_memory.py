"""The process's host memory: what it holds (read into every step's metrics) and handing the C
allocator's free memory back to the kernel after each step.

A training process allocates tensors of ever-changing sizes (micro-batches padded to their longest
row, a KV cache that grows). glibc's malloc serves blocks under its mmap threshold from heaps it returns
to the kernel only from their top, and it raises that threshold to the size of every large block freed
(up to 32 MiB), so most of a step's tensors come from heaps whose freed pages stay resident: a real
model's run grew past the machine's 23 GB until the kernel killed it (issue 28). `return_free_heap`
(`malloc_trim(0)`, which releases free pages anywhere in the heaps) after each step keeps what the
process holds close to what it uses. `benchmarks/host_memory.py` (SmolLM2-135M, four learner steps, one
thread): 1.86 GB resident after the steps against 3.49 GB without, for 5% more CPU time (pages faulted
in again); fixing the mmap threshold at 1 MiB as well cost 17% and saved nothing more resident, so it
is not done. Nothing happens where the C library is not glibc.

    return_free_heap()            # after each step
    rss_gb(), peak_rss_gb(), free_heap_gb()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from functools import cache


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
