"""CPU kernels compiled once per build key and cached (torch.utils.cpp_extension): paged decode
attention and the K/V store (paged_attention.cpp), paged prefill attention
(prefill_attention.cpp), the fused RMSNorm / residual-add + RMSNorm / RoPE / SiLU*up layers
(fused_ops.cpp), the sampler's row argmax (sampling_ops.cpp) and the few-row products of decode
steps (linear.cpp: AMX tiles for bf16 where the CPU has them, AVX-512 or AVX2 loops otherwise),
vectorized for what the compiler targets, scalar otherwise. The Python module is bindings.cpp,
the only file that includes <torch/extension.h>: the kernel files include ATen's headers alone
and compile beside it in seconds (the whole build ~27 s on 2 cores instead of ~120).

The cache (pdserve_kernels/cache.py, kind "cpu_kernels") holds one folder per build key: a hash
of the sources, the compiler flags, the -march, torch's and Python's versions, then a hash of
the compiler's identity (`c++ --version`). A process whose key has a folder imports its .so
directly: no compiler, no ninja, no lock, no write (a node start never compiles once
scripts/setup.sh, `pdserve serve` or an image's build stage has built it). A missing key is
built under a lock into a temporary folder and renamed into place, so a reader never sees a
half-written build and two processes with different keys (say two PDSERVE_CPU_MARCH values)
never rebuild each other's. Where no compiler is installed (a runtime image), a build of the
same sources and flags by any compiler is taken.

If the build is impossible (no compiler, no ninja), the engine falls back to its pure-torch
layers and logs why once. -march is native by default; an image meant for other machines than
the one that built it sets PDSERVE_CPU_MARCH (e.g. x86-64-v3) at build and at run time alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from types import ModuleType

from pdserve.kernels.cache import cache_dir

logger = logging.getLogger(__name__)

_NAME = "pdserve_cpu_attention"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [
    os.path.join(_HERE, name)
    for name in (
        "bindings.cpp",  # first: the longest to compile, started before the others
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "fused_ops.cpp",
        "sampling_ops.cpp",
        "linear.cpp",
        "thread_pool.cpp",
        "decoder_layers.cpp",
        "host_memory.cpp",
    )
]
_HEADERS = [
    os.path.join(_HERE, name)
    for name in (
        "vec.h",
        "thread_pool.h",
        "kernels.h",
        "decoder_layers.h",
        "host_memory.h",
        "spin_wait.h",
    )
]


def _cache_root() -> str:
    """PDSERVE_KERNEL_BUILD_DIR if set, else the shared cache folder (pdserve_kernels/cache.py)."""
    return os.environ.get("PDSERVE_KERNEL_BUILD_DIR") or str(cache_dir("cpu_kernels"))


def _march() -> str:
    """The -march the kernels are compiled for (part of the build key)."""
    return os.environ.get("PDSERVE_CPU_MARCH", "native")


def _cflags() -> list[str]:
    return ["-O3", f"-march={_march()}", "-ffast-math", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def _compiler_identity() -> str | None:
    """`$CXX --version` (torch's loader compiles with $CXX, else c++), or None if there is no
    compiler to run."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _torch_version() -> str:
    """torch's version from its installed metadata (the same string as torch.__version__ for
    its wheels), so that a process can find a build without importing torch (~2.5 s: `pdserve
    serve`'s supervisor checks that the kernels are built before it starts its children);
    torch.__version__ where no metadata is installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def build_key() -> tuple[str, str | None]:
    """(hash of sources, flags, -march, torch and Python versions; hash of the compiler's
    identity, None without a compiler). The folder of a build is named "<first>-<second>"."""
    h = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    h.update(" ".join(_cflags()).encode())
    h.update(f"{_torch_version()}|{platform.python_version()}|{platform.machine()}".encode())
    compiler = _compiler_identity()
    compiler_hash = None
    if compiler is not None:
        compiler_hash = hashlib.sha256(compiler.encode()).hexdigest()[:12]
    return h.hexdigest()[:16], compiler_hash


def _built_module(root: str, key: tuple[str, str | None]) -> str | None:
    """The .so of a finished build for key under root, if there is one."""
    source_key, compiler_key = key
    if compiler_key is not None:
        candidates = [os.path.join(root, f"{source_key}-{compiler_key}")]
    else:  # no compiler here: any compiler's build of these sources and flags
        candidates = sorted(glob.glob(os.path.join(root, f"{source_key}-*")))
    for folder in candidates:
        so = os.path.join(folder, f"{_NAME}.so")
        if os.path.isfile(so):
            return so
    return None


def built_folder() -> str | None:
    """The folder of this machine's finished build for the current key (sources, flags,
    compiler), or None if none is built yet."""
    so = _built_module(_cache_root(), build_key())
    return None if so is None else os.path.dirname(so)


def _import(so: str) -> ModuleType:
    import torch  # noqa: F401 - the extension links libtorch: torch loads it first

    loader = importlib.machinery.ExtensionFileLoader(_NAME, so)
    spec = importlib.util.spec_from_file_location(_NAME, so, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(root: str, key: tuple[str, str | None]) -> str:
    """Compile into a temporary folder under root and rename it into place; the .so's path."""
    from torch.utils.cpp_extension import load

    source_key, compiler_key = key
    if compiler_key is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++) and no prebuilt kernels")
    final = os.path.join(root, f"{source_key}-{compiler_key}")
    scratch = tempfile.mkdtemp(prefix=f".build-{source_key}-", dir=root)
    os.chmod(scratch, 0o755)  # mkdtemp's 0700 would hide the build from other users (images)
    try:
        load(
            build_directory=scratch,
            name=_NAME,
            sources=_SOURCES,
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        os.rename(scratch, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return os.path.join(final, f"{_NAME}.so")


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module (paged_decode_attention, paged_prefill_attention_out, store_kv,
    rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul, argmax_rows,
    pack_linear_weight / linear_small_m), built if this key has no build yet, or None
    if it cannot be built. Set PDSERVE_CPU_KERNELS=0 to force the pure-torch path."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        root = _cache_root()
        key = build_key()
        so = _built_module(root, key)
        if so is None:
            os.makedirs(root, exist_ok=True)
            with _locked(os.path.join(root, f".lock-{key[0]}")):
                so = _built_module(root, key)  # another process may have built it meanwhile
                if so is None:
                    start = time.monotonic()
                    so = _build(root, key)
                    logger.info(
                        "compiled the CPU kernels in %.0fs (cached in %s)",
                        time.monotonic() - start,
                        os.path.dirname(so),
                    )
        return _import(so)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU kernels unavailable (%s); using the torch path", exc)
        return None


_hot_lock = threading.Lock()
_hot_depth = 0


@contextlib.contextmanager
def threads_hot(ops: ModuleType | None) -> Iterator[None]:
    """Inside: the kernels' idle pool workers spin between loops instead of sleeping
    (thread_pool.h: a step's ~180 short loops then start without waking a thread), until the
    outermost of nested scopes ends. No effect without the kernels or their pool."""
    global _hot_depth
    if ops is None or not ops.kernel_pool_enabled():
        yield
        return
    with _hot_lock:
        _hot_depth += 1
        if _hot_depth == 1:
            ops.set_threads_hot(True)
    try:
        yield
    finally:
        with _hot_lock:
            _hot_depth -= 1
            if _hot_depth == 0:
                ops.set_threads_hot(False)
