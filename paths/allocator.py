"""Where a CPU training process (and a rollout worker) takes its large tensors' memory from.

glibc's malloc serves any block over its mmap threshold (128 KiB, rising to at most 32 MiB as it
adapts) with a fresh mmap() and returns it with munmap() when it is freed, and gives the top of
its heap back to the kernel past 128 KiB free. A training step allocates and frees the same large
activations, gradients and logits every step, so every step pays the kernel to map and zero those
pages again: on this project's 2-core CPU bench (bench/train.py) a tenth of the step; a rollout
worker's KV caches and logits likewise, token after token (its first batch took twice as long).
The trainer and the worker therefore, on glibc, serve blocks up to 1 GiB from the heap and keep
up to 1 GiB of freed heap, as PyTorch's CPU tuning guide gets from jemalloc or tcmalloc: the
memory a step frees is reused by the next, at the cost of that much resident memory kept between
steps. PATHS_MALLOC=system leaves the allocator as it is.

The setting is the process's, from the trainer's (or the worker's) start to its exit (in-process
callers such as the quickstart and the test suite keep it after they return); the heap keeps its
peak (a checkpoint's buffers included) rather than exactly 1 GiB; blocks over 64 MiB allocated
from a thread other than the main one still get an mmap() (glibc's other arenas cap their heaps
there).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to KEEP for this process (see the module docstring);
    whether they were set (False on another C library, or with PATHS_MALLOC=system)."""
    if os.environ.get("PATHS_MALLOC", "").strip().lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: these parameters mean something else, or nothing, elsewhere
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped, trimmed = mallopt(M_MMAP_THRESHOLD, KEEP), mallopt(M_TRIM_THRESHOLD, KEEP)
    return bool(mapped and trimmed)
