"""CPU kernels compiled on first use (torch.utils.cpp_extension, cached across runs): paged
decode attention and the K/V store (paged_attention.cpp), the fused RMSNorm / residual-add +
RMSNorm / RoPE / SiLU*up layers (fused_ops.cpp) and the sampler's row argmax
(sampling_ops.cpp), AVX-512 where the compiler targets it, scalar otherwise.

If the build is impossible (no compiler, no ninja), the engine falls back to its pure-torch
layers and logs why once.

A prebuilt module (a container image builds it in its build stage) loads without a compiler:
torch re-emits build.ninja and runs ninja, which finds every output up to date, as long as the
sources, the flags and the paths are the ones it was built with. -march is native by default;
an image meant for other machines than the one that built it sets PDSERVE_CPU_MARCH (e.g.
x86-64-v3) at build and at run time alike.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import ModuleType

from pdserve.kernels.cache import cache_dir

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [
    os.path.join(_HERE, name)
    for name in ("paged_attention.cpp", "fused_ops.cpp", "sampling_ops.cpp")
]


def _build_dir() -> str:
    """PDSERVE_KERNEL_BUILD_DIR if set, else the shared cache folder (pdserve_kernels/cache.py)."""
    return os.environ.get("PDSERVE_KERNEL_BUILD_DIR") or str(cache_dir("cpu_kernels"))


def _march() -> str:
    """The -march the kernels are compiled for (a different value means a rebuild)."""
    return os.environ.get("PDSERVE_CPU_MARCH", "native")


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module (paged_decode_attention, store_kv, rms_norm, fused_add_rms_norm,
    rotary_embedding, silu_and_mul, argmax_rows), or None if it cannot be built.
    Set PDSERVE_CPU_KERNELS=0 to force the pure-torch path."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.monotonic()
        build_dir = _build_dir()
        os.makedirs(build_dir, exist_ok=True)
        module = load(
            build_directory=build_dir,
            name="pdserve_cpu_attention",
            sources=_SOURCES,
            extra_cflags=[
                "-O3",
                f"-march={_march()}",
                "-ffast-math",
                "-ffp-contract=off",
                "-fopenmp",
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        elapsed = time.monotonic() - start
        if elapsed > 2:  # a compile, not a cache hit
            logger.info(
                "compiled the CPU attention kernels in %.0fs (cached in %s)", elapsed, build_dir
            )
        return module
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU attention kernels unavailable (%s); using the torch path", exc)
        return None
