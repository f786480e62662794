"""Process-level tuning for CPU inference."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_done = False


def tune_allocator() -> None:
    """Keep freed activation buffers in glibc's heap instead of returning them to the OS.

    By default glibc serves allocations above ~128 KiB-32 MiB with fresh mmap()s and unmaps them
    on free, so every step's multi-MiB temporaries page-fault again on first touch: elementwise
    ops on a 2048-token chunk ran ~10x slower than memory bandwidth allows. (vLLM's CPU build
    preloads tcmalloc for the same reason.) Idempotent; a no-op off glibc."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(
            libc.mallopt(param, value)
            for param, value in (
                (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum
                (_M_TRIM_THRESHOLD, 1 << 30),
                (_M_TOP_PAD, 64 << 20),
            )
        )
        if not ok:
            logger.debug("mallopt refused a setting; allocator left as is")
    except (OSError, AttributeError) as exc:
        logger.debug("allocator tuning unavailable: %s", exc)


def freeze_startup_objects() -> None:
    """Move everything allocated so far (model, tokenizer, protobuf descriptors, ...) into the
    collector's permanent generation. Full collections then no longer walk those millions of
    objects: in a serving process their pauses otherwise show up as inter-token latency spikes
    (vLLM's servers do the same). Call once, when start-up is done."""
    gc.collect()
    gc.freeze()
