"""Host memory (engine/host_memory.py). The CPU KV cache (zeroed_lazily): zeros, writable, on
transparent huge pages where the kernel offers them for madvise'd memory, and faulted in by a
background thread (prefault_in_background) without a byte of it changing. The few-row kernel's
weights (huge_page_copies): equal copies, on huge pages, in one mapping."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, model_runner
from pdserve.engine.host_memory import huge_page_copies, zeroed_lazily
from pdserve.engine.model_runner import memory_headroom, prefault_in_background

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


def _thp_offered() -> bool:
    return "[never]" not in (THP.read_text() if THP.exists() else "[never]")


def test_huge_page_copies_are_equal_and_share_one_mapping_on_huge_pages() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(960 * 576, generator=g),  # 2.1 MiB
        torch.randn(77, 33, generator=g).bfloat16(),  # odd size: the next one is realigned
        torch.randn(3072, 576, generator=g),
    ]
    copies = huge_page_copies(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
        assert copy.data_ptr() % 64 == 0
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1, "the copies should share one mapping"
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, copies[1:], strict=False))
    del tensors
    gc.collect()
    assert torch.isfinite(copies[2]).all()  # the mapping outlives the originals
    if _thp_offered():
        assert _smaps_kib(copies[2].data_ptr(), "AnonHugePages:") >= 2048


def test_huge_page_copies_leave_small_sets_and_refuse_strided_tensors() -> None:
    small = [torch.ones(10), torch.zeros(3, 4)]
    assert all(a is b for a, b in zip(huge_page_copies(small), small, strict=True))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        huge_page_copies([torch.zeros(1024, 1024).t()])


def test_loaded_model_keeps_its_few_row_weights_in_one_mapping(tiny_llama, monkeypatch) -> None:
    from pdserve.engine import host_memory
    from pdserve.engine.models.llama import Linear, pack_small_rows
    from pdserve.engine.models.loader import load_model
    from pdserve.kernels.cpu import cpu_ops

    monkeypatch.setattr(host_memory, "HUGE_PAGE", 4096)  # the tiny model's weights: < 2 MiB
    model, _ = load_model(tiny_llama, "float32")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    smalls = [m.small for m in linears if m.small is not None]
    ops = cpu_ops()
    if ops is None or not ops.linear_small_m_available():
        assert smalls == []  # nothing to place: the products go through oneDNN
        return
    assert smalls, "no projection took the few-row kernel's layout"
    if model._small_tied_head is not None:
        smalls.append(model._small_tied_head)
    assert len({s.untyped_storage().data_ptr() for s in smalls}) == 1
    for m in linears:
        expected = pack_small_rows(m.weight)  # None where K is not a multiple of 32
        assert (m.small is None) == (expected is None)
        assert expected is None or torch.equal(m.small, expected)


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


def test_prefault_never_stalls_the_process_while_every_core_is_busy() -> None:
    """madvise holds the process's mmap lock while it faults pages in. The prefault used to run
    it at idle priority: preempted inside it while other processes kept every core busy, it
    blocked this process's every mmap and munmap for seconds (here 5.5 s for one), and a
    decode node stalled that way missed the gateway's health polls. Now it faults only after a
    core stayed free for 2 ms, at normal priority: with every core busy, nothing is faulted in
    and no mmap waits."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    cache = zeroed_lazily((8, 1024, 128 * 1024), torch.bfloat16)  # 2 GiB, never touched
    try:
        time.sleep(0.3)
        thread = prefault_in_background(cache)
        assert thread is not None
        worst_s = 0.0
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            start = time.monotonic()
            scratch = mmap.mmap(-1, 64 << 20)
            scratch[0] = 1
            scratch.close()
            worst_s = max(worst_s, time.monotonic() - start)
        assert worst_s < 0.5, f"an mmap + munmap waited {worst_s:.2f} s behind the prefault"
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=10)
    del cache
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_prefault_leaves_the_reserve_free(monkeypatch) -> None:
    shape = (3, 64, 2, 4, 16, 64)  # 12 MiB; 1.5 MiB of headroom over the reserve: none of it
    cache = zeroed_lazily(shape, torch.float32)
    monkeypatch.setattr(model_runner, "memory_headroom", lambda: (1 << 30) + (3 << 19))
    thread = prefault_in_background(cache)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _smaps_kib(cache.data_ptr(), "Rss:") < 12 * 1024 // 2


def test_an_idle_window_starts_a_run_of_short_waits() -> None:
    run = model_runner._PREFAULT_RUN_CHUNKS
    fast, slow = 0.001, 10 * model_runner._PREFAULT_RUN_CALL_S
    assert model_runner.next_prefault_run(0, True, False, slow) == run - 1  # a far wait: idle
    assert model_runner.next_prefault_run(3, False, False, fast) == 2  # the run goes on
    assert model_runner.next_prefault_run(1, False, False, fast) == 0  # and ends
    assert model_runner.next_prefault_run(5, False, False, slow) == 0  # the core was busy
    assert model_runner.next_prefault_run(4, False, True, slow) == 4  # near chunks: no change
    assert model_runner.next_prefault_run(0, False, False, fast) == 0


def test_an_idle_process_faults_most_far_chunks_after_short_waits(monkeypatch) -> None:
    """Far chunks used to wait 20 ms each for a free core even on an idle machine (an idle
    node's 4 GiB: ~48 s); after one such wait a run of chunks waits 2 ms each."""
    ops = model_runner.cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels did not build")
    waits: list[float] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(ops, name)

        def populate_when_idle(self, addr, length, wait_s, free_s):
            waits.append(free_s)
            return ops.populate_when_idle(addr, length, wait_s, free_s)

    monkeypatch.setattr(model_runner, "cpu_ops", lambda: Recording())
    shape = (2, 1024, 2, 4, 16, 64)  # 64 MiB float32; 64 blocks (2 MiB) a chunk and layer
    cache = zeroed_lazily(shape, torch.float32)
    thread = prefault_in_background(cache, high_water=lambda: 0)  # blocks past 256: far
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _smaps_kib(cache.data_ptr(), "Rss:") >= 64 * 1024
    far = waits.count(model_runner._PREFAULT_FAR_FREE_S)
    assert len(waits) >= 32 and far <= 8, f"{far} of {len(waits)} waits took 20 ms"


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
