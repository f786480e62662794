"""Decode-role scheduling: blocks reserved for remote prefill, then join or fall back (no model)."""

from dataclasses import replace

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import RequestStatus
from tests.engine.test_scheduler import make, req, run, sizes


def remote(rid, n, **kw):
    r = req(rid, n, **kw)
    r.wants_remote_prefill = True
    return r


def test_remote_request_reserves_prompt_blocks_without_budget_and_joins_on_arrival():
    s = make(num_blocks=20, block_size=4, budget=16)
    s.add_request(remote("a", 10))
    s.add_request(req("b", 3))
    out, _ = run(s)
    # a's 3 prompt blocks are reserved and no budget is spent on it; b runs locally
    assert [
        (p.request_id, p.block_ids, p.num_local_cached_tokens) for p in out.remote_prefills
    ] == [("a", [1, 2, 3], 0)]
    assert sizes(out) == {"b": 3}
    a = s.requests["a"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KV and s.num_awaiting_kv == 1
    out, _ = run(s)
    assert sizes(out) == {"b": 1} and not out.remote_prefills
    update = s.finish_remote_prefill("a", SampledTokens([42]), num_cached_tokens=4)
    assert update.new_token_ids == [42] and not update.finished
    assert a.num_computed_tokens == 10 and a.output_token_ids == [42] and a.num_cached_tokens == 4
    out, _ = run(s)
    assert sizes(out) == {"b": 1, "a": 1}
    chunk = next(c for c in out.chunks if c.request_id == "a")
    assert chunk.token_ids == [42] and chunk.start_pos == 10 and chunk.block_ids == [1, 2, 3]


def test_remote_blocks_enter_the_prefix_cache_only_after_arrival():
    s = make(num_blocks=20, block_size=4, budget=16)
    s.add_request(remote("a", 9))
    run(s)
    twin = req("twin", 9)
    assert s.kv.get_computed_blocks(twin).num_tokens == 0
    s.finish_remote_prefill("a", SampledTokens([1]), 0)
    assert s.kv.get_computed_blocks(twin).num_tokens == 8


def test_local_prefix_is_skipped_and_short_uncached_part_stays_local():
    s = make(num_blocks=20, block_size=4, budget=32)
    s.config = replace(s.config, remote_prefill_min_tokens=4)
    s.add_request(req("warm", 9, max_tokens=1))
    run(s)  # warm finishes after one step; its 2 full blocks stay cached
    s.add_request(remote("a", 12))  # 8 cached, 4 uncached >= 4: remote, skipping 2 blocks
    s.add_request(remote("b", 10))  # 8 cached, 2 uncached < 4: local
    out, _ = run(s)
    (p,) = out.remote_prefills
    assert p.request_id == "a" and p.num_local_cached_tokens == 8 and len(p.block_ids) == 3
    assert sizes(out) == {"b": 2}
    assert not s.requests["b"].wants_remote_prefill


def test_failed_remote_prefill_falls_back_to_local_compute_in_the_reserved_blocks():
    s = make(num_blocks=20, block_size=4, budget=16)
    s.add_request(remote("a", 10))
    out, _ = run(s)
    blocks = out.remote_prefills[0].block_ids
    s.fail_remote_prefill("a")
    out, ups = run(s)
    assert sizes(out) == {"a": 10} and out.chunks[0].start_pos == 0
    assert out.chunks[0].block_ids == blocks and ups[0].new_token_ids == [7]


def test_abort_while_awaiting_kv_frees_the_reserved_blocks():
    s = make(num_blocks=20, block_size=4, budget=16)
    free_before = s.kv.num_free_blocks
    s.add_request(remote("a", 10))
    run(s)
    assert s.kv.num_free_blocks == free_before - 3
    s.abort_request("a")
    assert s.kv.num_free_blocks == free_before and not s.has_unfinished()
    assert s.finish_remote_prefill("a", SampledTokens([1]), 0) is None


def test_remote_reservation_waits_for_blocks_and_counts_toward_max_num_seqs():
    s = make(num_blocks=4, block_size=4, budget=16, max_seqs=2)  # 3 usable blocks
    s.add_request(remote("a", 10))
    s.add_request(remote("b", 10))
    out, _ = run(s)
    assert [p.request_id for p in out.remote_prefills] == ["a"] and s.num_waiting == 1
    assert s.requests["b"].wants_remote_prefill  # still to be offered
    s.abort_request("a")
    out, _ = run(s)
    assert [p.request_id for p in out.remote_prefills] == ["b"]


def test_first_token_can_finish_the_request():
    s = make()
    s.add_request(remote("a", 5, max_tokens=1))
    run(s)
    update = s.finish_remote_prefill("a", SampledTokens([3]), 0)
    assert update.finished and update.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv.num_free_blocks == 19 and not s.has_unfinished()


def test_queue_aware_prompts_go_to_the_shorter_prefill_queue():
    s = make(num_blocks=40, block_size=4, budget=8, caching=False)  # equal prompts: no sharing
    s.config = replace(s.config, max_remote_prefill_queue_tokens=8)
    s.add_request(remote("a", 10))  # remote backlog 0 < 8: remote
    s.add_request(remote("b", 10))  # remote backlog 10 >= 8, local 0 + 10 <= 10: local
    s.add_request(remote("c", 10))  # local 10 (b, not computed yet) + 10 > 10: remote
    out, _ = run(s)
    assert [p.request_id for p in out.remote_prefills] == ["a", "c"]
    assert sizes(out) == {"b": 8}  # local prefill chunked by the node's budget
    assert s.remote_prefill_backlog == 20 and s.local_prefill_backlog == 2
    s.add_request(remote("d", 12))  # local 2 + 12 <= 20: local, behind b
    out, _ = run(s)
    assert sizes(out) == {"b": 2, "d": 6} and not out.remote_prefills
    s.finish_remote_prefill("a", SampledTokens([1]), 0)
    s.finish_remote_prefill("c", SampledTokens([1]), 0)
    assert s.remote_prefill_backlog == 0
    s.add_request(remote("e", 10))  # remote backlog 0 < 8 again: remote
    out, _ = run(s)
    assert [p.request_id for p in out.remote_prefills] == ["e"]


def test_queue_aware_threshold_keeps_prompts_remote_below_it():
    s = make(num_blocks=40, block_size=4, budget=8, caching=False)
    s.config = replace(s.config, max_remote_prefill_queue_tokens=21)
    for rid in "abc":
        s.add_request(remote(rid, 10))  # backlogs 0, 10, 20 < 21: all remote
    out, _ = run(s)
    assert [p.request_id for p in out.remote_prefills] == ["a", "b", "c"]
    assert not out.chunks
    s.add_request(remote("d", 10))  # 30 >= 21 and local 10 <= 30: local
    out, _ = run(s)
    assert sizes(out) == {"d": 8} and not out.remote_prefills


def test_queue_aware_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match="max_remote_prefill_queue_tokens"):
        SchedulerConfig(max_remote_prefill_queue_tokens=-1)


def test_a_local_request_left_without_budget_is_not_looked_up_in_the_prefix_cache():
    s = make(budget=8)
    s.add_request(req("a", 10))
    s.add_request(req("b", 4))
    run(s)  # a takes the whole budget; b waits without a lookup (prefix_cache_queries counts it)
    assert s.kv.prefix_queries == 10
    out, _ = run(s)
    assert sizes(out) == {"a": 2, "b": 4} and s.kv.prefix_queries == 14
