"""The allocator policy of trainer.host_memory on this machine's glibc: freed heap memory is counted and
handed back to the kernel."""

from __future__ import annotations

import ctypes
import subprocess
import sys

from pacerl.trainer.host_memory import _glibc, free_heap_gb, return_free_heap, rss_gb

BLOCK = 64 * 1024  # under glibc's mmap threshold: served from the heap
BLOCKS = 4096  # 256 MiB


def test_this_machine_has_glibc() -> None:
    assert _glibc() is not None, "these machines run Debian's glibc"


def test_freed_heap_blocks_are_counted_and_returned() -> None:
    # In a fresh interpreter, so that the heap holds nothing else of size.
    script = f"""
import ctypes
from pacerl.trainer.host_memory import _glibc, free_heap_gb, return_free_heap, rss_gb
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc({BLOCK}) for _ in range({BLOCKS})]
for block in blocks:
    ctypes.memset(block, 1, {BLOCK})  # resident
pin = libc.malloc({BLOCK})  # above them: the heap's top cannot shrink past it
ctypes.memset(pin, 1, {BLOCK})
free_before, rss_full = free_heap_gb(), rss_gb()
for block in blocks:
    libc.free(block)
free_after, rss_freed = free_heap_gb(), rss_gb()
return_free_heap()
print(free_before, free_after, rss_full, rss_freed, rss_gb())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    free_before, free_after, rss_full, rss_freed, rss_returned = map(float, out.stdout.split())
    held = BLOCK * BLOCKS / 2**30
    assert free_after - free_before > 0.9 * held  # the holes are counted as free heap
    assert rss_full - rss_freed < 0.1 * held  # freeing alone keeps them resident (pinned heap)
    assert rss_freed - rss_returned > 0.9 * held  # handing them back releases the pages


def test_the_readers_are_sane_in_this_process() -> None:
    return_free_heap()
    assert free_heap_gb() >= 0 and rss_gb() > 0
    assert isinstance(_glibc(), ctypes.CDLL)
