"""glibc malloc settings for a training process: keep freed gradient-sized blocks instead of unmapping them.

Every step, autograd allocates fresh gradient tensors where ``zero_grad(set_to_none=True)`` left ``None``, and
frees them once the reducer has moved them into their buckets. Blocks above glibc's mmap threshold (128 KiB,
raised dynamically up to 32 MiB) are ``mmap``ed and ``munmap``ed each time, and every page of a fresh mapping
is a minor page fault when first touched: thousands per step on a model of a few hundred MiB. Raising the mmap
threshold to its maximum and the trim threshold keeps those blocks in the heap, reused from one step to the
next (``benchmarks/allocator.py`` measures faults and step time with and without). The cost: memory freed by
the process stays mapped (its resident size does not shrink after a peak).

:func:`tune` applies it once per process; the Ray worker calls it when ``ElasticTrainer(tune_allocator=True)``
(the default). It is a no-op (returning False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from .log import get_logger

_log = get_logger(__name__)

#: glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB * sizeof(long)).
MMAP_THRESHOLD_BYTES = 32 * 2**20

#: Freed memory at the top of the heap is returned to the system only beyond this much.
TRIM_THRESHOLD_BYTES = 1 * 2**30

_applied: bool | None = None


def tune(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES, trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap and trim thresholds in this process; True if glibc took both."""
    global _applied
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        _log.info("glibc's mallopt is not available (%s); the allocator keeps its defaults", exc)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes))
    if not ok:
        _log.warning("glibc refused mallopt(M_MMAP_THRESHOLD=%d, M_TRIM_THRESHOLD=%d); the allocator keeps its "
                     "defaults", mmap_threshold_bytes, trim_threshold_bytes)
    _applied = ok
    return ok


def applied() -> bool | None:
    """Whether :func:`tune` ran in this process and glibc took it (None: it did not run)."""
    return _applied
