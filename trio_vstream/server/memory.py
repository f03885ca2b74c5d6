"""glibc allocator settings for a process that handles many large, short-lived buffers.

Video frames and tensors are tens of MiB each and live for one chunk. With glibc's
defaults, buffers that size are mmap'ed and unmapped every time, and each worker
thread gets its own arena, so every chunk faults its memory in afresh and an engine
call that lands on a different worker thread starts from a cold arena. Measured on
the diffusers benchmark, that alone cost up to 6% of a segment's generation time.
So the server process keeps such buffers on one heap and gives memory back to the
system only once it has been idle for a while (``return_free_memory``).

Elsewhere (macOS, musl) these are no-ops. Settings a user made through the
``MALLOC_*`` environment variables are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from trio_vstream.logsafe import get_logger

logger = get_logger(__name__)

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_SETTINGS = {
    "MALLOC_ARENA_MAX": (_M_ARENA_MAX, 1),
    "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, 32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, 128 * 1024 * 1024),
}


def _load_glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_GLIBC = _load_glibc()


def tune_allocator() -> None:
    """Apply the settings above; call once at start-up, before worker threads exist."""
    if _GLIBC is None:
        return
    for variable, (parameter, value) in _SETTINGS.items():
        if variable not in os.environ and not _GLIBC.mallopt(parameter, value):
            logger.debug("mallopt(%d, %d) refused", parameter, value)


def return_free_memory() -> None:
    """Give freed heap memory back to the system (blocking, for milliseconds)."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)
