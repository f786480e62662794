"""The CPU KV cache's memory (engine/model_runner.zeroed_lazily): zeros, writable, on
transparent huge pages where the kernel offers them for madvise'd memory, and faulted in by a
background thread (prefault_in_background) without a byte of it changing."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, model_runner
from pdserve.engine.model_runner import memory_headroom, prefault_in_background, zeroed_lazily

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_kib(address: int, field: str) -> int:
    """An smaps field (KiB: "Rss:", "AnonHugePages:") of this process's mapping that holds
    address."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith(field):
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
        huge_kib = _smaps_kib(cache.data_ptr(), "AnonHugePages:")
        assert huge_kib >= 2048, f"no huge pages (THP: {mode.strip()})"


def test_prefault_maps_every_page_and_changes_nothing() -> None:
    shape = (3, 64, 2, 4, 16, 64)  # layers, blocks, K/V, heads, slots, dims: 12 MiB float32
    total_kib = 3 * 64 * 2 * 4 * 16 * 64 * 4 // 1024
    cache = zeroed_lazily(shape, torch.float32)
    cache[1, 5].fill_(3.0)  # blocks in use while the thread runs keep their contents
    cache[2, 63].fill_(-1.0)
    assert _smaps_kib(cache.data_ptr(), "Rss:") < total_kib
    thread = prefault_in_background(cache)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _smaps_kib(cache.data_ptr(), "Rss:") >= total_kib
    expected = torch.zeros(shape)
    expected[1, 5] = 3.0
    expected[2, 63] = -1.0
    assert torch.equal(cache, expected)


def test_prefault_leaves_the_reserve_free(monkeypatch) -> None:
    shape = (3, 64, 2, 4, 16, 64)  # 12 MiB; 1.5 MiB of headroom over the reserve: none of it
    cache = zeroed_lazily(shape, torch.float32)
    monkeypatch.setattr(model_runner, "memory_headroom", lambda: (1 << 30) + (3 << 19))
    thread = prefault_in_background(cache)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _smaps_kib(cache.data_ptr(), "Rss:") < 12 * 1024 // 2


def test_memory_headroom_is_at_most_memavailable() -> None:
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    assert 0 < memory_headroom() <= available + (256 << 20)  # it moves between the reads


def test_prefault_stops_once_the_cache_is_freed() -> None:
    cache = zeroed_lazily((2, 1024, 256 * 1024), torch.float32)  # 2 GiB, never touched
    thread = prefault_in_background(cache)
    assert thread is not None
    del cache
    gc.collect()
    thread.join(timeout=30)  # a whole 2 GiB would take seconds here; one chunk, milliseconds
    assert not thread.is_alive()


@pytest.mark.parametrize(("flag", "env", "runs"), [(True, "1", True), (True, "0", False),
                                                    (False, "1", False)])  # fmt: skip
def test_engine_prefaults_unless_told_not_to(tiny_llama, monkeypatch, flag, env, runs) -> None:
    monkeypatch.setenv("PDSERVE_KV_CACHE_PREFAULT", env)  # tests/conftest.py sets 0
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=1024, kv_cache_prefault=flag)
    thread = llm.engine._prefault
    assert (thread is not None) == runs
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()
        cache = llm.engine.runner.kv_cache
        assert _smaps_kib(cache.data_ptr(), "Rss:") * 1024 >= cache.numel() * 4
