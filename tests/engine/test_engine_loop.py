"""One step's output (StepOutput), the prefill role's request property, and who may touch the
engine: its own thread only, once the EngineLoop has claimed it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RemotePrefill, RequestUpdate, SampledTokens, StepOutput
from pdserve.engine.request import RequestStatus, SamplingParams

PROMPT = list(range(300, 340))  # 40 tokens: 3 blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def engine(model: str) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model, dtype="float32"),
        CacheConfig(num_blocks=32),
        SchedulerConfig(remote_prefill_min_tokens=1),
    )


def test_a_step_returns_its_remote_prefills_and_dates_first_scheduling(tiny_llama):
    eng = engine(tiny_llama)
    eng.add_request("r", PROMPT, GREEDY, wants_remote_prefill=True)
    before = time.monotonic()
    step = eng.step()
    after = time.monotonic()
    assert isinstance(step, StepOutput) and step.updates == [] and bool(step)
    (rp,) = step.remote_prefills
    assert rp.request_id == "r" and len(rp.block_ids) == 3 and rp.num_local_cached_tokens == 0
    assert not eng.has_work()  # nothing to compute until the KV arrives
    update = eng.finish_remote_prefill("r", SampledTokens([7]), 0)
    assert update is not None and update.new_token_ids == [7]
    assert before <= update.scheduled_s <= after  # the reservation's step, not the join
    (later,) = eng.step().updates
    assert later.scheduled_s == update.scheduled_s and len(later.new_token_ids) == 1
    eng.abort_request("r")
    assert not eng.step()  # an empty step is falsy


def test_prefill_only_requests_end_after_their_first_token_with_blocks_freed(tiny_llama):
    eng = engine(tiny_llama)
    free = eng.kv.num_free_blocks
    eng.add_request("p", PROMPT, GREEDY, prefill_only=True)
    (update,) = eng.step().updates
    assert update.status is RequestStatus.FINISHED_PREFILLED and update.finished
    assert len(update.new_token_ids) == 1 and update.status.finish_reason is None
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_free_blocks == free  # full blocks stay cached, evictable
    # the same first token a whole local request samples
    eng.add_request("whole", PROMPT, GREEDY)
    (first,) = eng.step().updates
    assert first.new_token_ids == update.new_token_ids and not first.finished


def test_a_claimed_engine_refuses_every_other_thread(tiny_llama):
    eng = engine(tiny_llama)
    eng.kv_cache  # noqa: B018 - unclaimed: anyone may (start-up wiring)
    owner = threading.Thread(target=eng.claim_thread)
    owner.start()
    owner.join()
    with pytest.raises(RuntimeError, match="belongs to thread"):
        eng.add_request("x", PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="belongs to thread"):
        eng.kv_cache  # noqa: B018 - writing received KV is a change of engine state
    for call in (eng.step, lambda: eng.abort_request("x"), lambda: eng.fail_remote_prefill("x")):
        with pytest.raises(RuntimeError, match="belongs to thread"):
            call()
    assert eng.load().num_waiting == 0  # reading the load is fine from anywhere


def test_the_loop_delivers_remote_prefills_on_the_request_stream(tiny_llama):
    """The decode role's path: reservation -> stream -> KV written on the engine thread ->
    join -> tokens; a write from the event loop itself is refused."""

    async def main() -> tuple[list[int], list[int]]:
        eng = engine(tiny_llama)
        loop = EngineLoop(eng, asyncio.get_running_loop())
        loop.start()
        try:
            stream = loop.open_stream("r")
            await loop.call(lambda e: e.add_request("r", PROMPT, GREEDY, wants_remote_prefill=True))
            rp = await stream.get(timeout_s=30)
            assert isinstance(rp, RemotePrefill) and rp.request_id == "r"
            with pytest.raises(RuntimeError, match="belongs to thread"):
                eng.kv_cache  # noqa: B018 - the event loop may not write blocks
            threads = []

            def write_kv(e: LLMEngine) -> None:
                threads.append(threading.current_thread().name)
                e.kv_cache[:, rp.block_ids] = 0.5

            await loop.call(write_kv)
            update = await loop.call(lambda e: e.finish_remote_prefill("r", SampledTokens([11]), 0))
            loop.publish([update])
            tokens = []
            while True:
                item = await stream.get(timeout_s=30)
                assert isinstance(item, RequestUpdate)
                tokens += item.new_token_ids
                if item.finished:
                    break
            # the two full prompt blocks hold what was written (decode wrote into the third)
            full = rp.block_ids[:2]
            written = await loop.call(lambda e: bool((e.kv_cache[:, full] == 0.5).all()))
            assert written
            return threads, tokens
        finally:
            loop.stop()

    threads, tokens = asyncio.run(main())
    assert threads == ["engine"]
    assert tokens[0] == 11 and len(tokens) == GREEDY.max_tokens


def test_a_remote_prefill_nobody_waits_for_prefills_locally(tiny_llama):
    async def main() -> list[RequestUpdate]:
        eng = engine(tiny_llama)
        loop = EngineLoop(eng, asyncio.get_running_loop())
        loop.start()
        try:
            # no stream opened: nobody will run the remote prefill, so the loop fails it
            await loop.call(lambda e: e.add_request("r", PROMPT, GREEDY, wants_remote_prefill=True))
            for _ in range(300):
                if not await loop.call(lambda e: e.has_unfinished_requests()):
                    break
                await asyncio.sleep(0.02)
            return await loop.call(lambda e: e.load())
        finally:
            loop.stop()

    load = asyncio.run(main())
    assert load.num_awaiting_kv == 0 and load.num_running == 0
    assert load.num_generation_tokens == GREEDY.max_tokens  # computed locally, to the end


def test_kv_cache_is_the_runner_tensor(tiny_llama):
    eng = engine(tiny_llama)
    assert isinstance(eng.kv_cache, torch.Tensor) and eng.kv_cache.shape[1] == 32
