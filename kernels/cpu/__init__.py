"""CPU kernels compiled on first use (torch.utils.cpp_extension, cached across runs).

If the build is impossible (no compiler, no ninja), the engine falls back to its pure-torch
attention and logs why once.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), "paged_attention.cpp")]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module (paged_decode_attention), or None if it cannot be built.
    Set PDSERVE_CPU_KERNELS=0 to force the pure-torch path."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.monotonic()
        module = load(
            name="pdserve_cpu_attention",
            sources=_SOURCES,
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        logger.debug("CPU kernels ready in %.1fs", time.monotonic() - start)
        return module
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU attention kernels unavailable (%s); using the torch path", exc)
        return None
