"""Keep freed memory in the process instead of handing it back to the kernel (glibc only).

Serving a batch decompresses every group into a fresh ~100 KB buffer and frees it once
sent. glibc returns freed memory at the top of its heap to the kernel as soon as more than
128 KB of it is free (and maps anything larger than 128 KB on its own), so the next batch
touches new pages again: ~25 minor page faults per post at 16 groups a batch, each a few
microseconds on a virtual machine, about a twentieth of the server's CPU. Raising both
thresholds keeps up to `TRIM_BYTES` of freed memory for reuse; resident memory stays at
the high-water mark of what was in use at once (bounded by the request and batch limits),
not at anything that grows with the queue.
"""

from __future__ import annotations

import ctypes
import platform

#: glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Free memory kept at the top of a heap before any is returned.
TRIM_BYTES = 64 * 1024 * 1024
#: Allocations this large and larger get pages of their own (glibc caps it at 32 MB).
MMAP_BYTES = 16 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds for this process; False where there is no glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
