"""The CPU KV cache's memory (engine/model_runner.zeroed_lazily): zeros, writable, and on
transparent huge pages where the kernel offers them for madvise'd memory."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.model_runner import zeroed_lazily

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds address."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_small_cache_is_zero_and_writable() -> None:
    cache = zeroed_lazily((3, 5, 7), torch.bfloat16)
    assert cache.shape == (3, 5, 7) and cache.dtype == torch.bfloat16
    assert not cache.any()
    cache.fill_(1.5)
    assert (cache == 1.5).all()


def test_large_cache_is_zero_writable_and_on_huge_pages() -> None:
    shape = (4, 1024, 1024)  # 16 MiB of float32
    cache = zeroed_lazily(shape, torch.float32)
    assert cache.shape == shape and not cache.any()
    cache.fill_(2.0)  # touches every page
    assert (cache == 2.0).all()
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" not in mode:
        # a shared anonymous mapping (Python mmap's default) is shmem and got no huge pages
        # here: the cache must be a private mapping
        assert _anon_huge_kib(cache.data_ptr()) >= 2048, f"no huge pages (THP: {mode.strip()})"
