"""Scheduler unit tests: exact budgets, block ids, preemption and resume (no model)."""

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import Scheduler


def make(
    num_blocks=20,
    block_size=4,
    budget=16,
    max_seqs=8,
    policy="fcfs",
    caching=True,
    cap=None,
    chunked=True,
):
    kv = KVCacheManager(num_blocks, block_size, caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        enable_chunked_prefill=chunked,
        max_prefill_tokens_while_decoding=cap,
    )
    return Scheduler(cfg, kv, max_model_len=1000)


def req(rid, n, max_tokens=4, priority=0, t=0.0, eos=None, **kw):
    return Request(
        rid,
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_ids=(eos,) if eos is not None else (),
        priority=priority,
        arrival_time=t,
    )


def run(s, token=7):
    """One step where every sampling chunk yields `token`."""
    out = s.schedule()
    sampled = {c.request_id: SampledTokens([token]) for c in out.chunks if c.samples}
    return out, s.update_from_output(out, sampled)


def sizes(out):
    return {c.request_id: len(c.token_ids) for c in out.chunks}


def test_chunked_prefill_under_budget_then_decode_first():
    s = make(budget=8)
    s.add_request(req("a", 10))
    s.add_request(req("b", 3))
    out, _ = run(s)
    assert sizes(out) == {"a": 8} and out.num_batched_tokens == 8
    assert out.chunks[0].start_pos == 0 and not out.chunks[0].samples
    assert out.chunks[0].block_ids == [1, 2]
    out, ups = run(s)
    # a finishes its prompt (2 tokens, samples), b gets the rest of the budget
    assert sizes(out) == {"a": 2, "b": 3}
    assert [c.samples for c in out.chunks] == [True, True]
    assert [u.new_token_ids for u in ups] == [[7], [7]]
    out, _ = run(s)
    assert sizes(out) == {"a": 1, "b": 1}
    assert out.chunks[0].token_ids == [7] and out.chunks[0].start_pos == 10


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 2))
    out, _ = run(s)
    assert sizes(out) == {"0": 2, "1": 2} and s.num_waiting == 1


def test_finish_on_max_tokens_eos_and_stop_ids_frees_blocks():
    s = make()
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("eos", 3, eos=7))
    s.add_request(req("stop", 3, stop_token_ids=[7]))
    s.add_request(req("min", 3, eos=7, min_tokens=2))
    _, ups = run(s)
    done = {u.request_id: u.status for u in ups if u.finished}
    assert done == {"eos": RequestStatus.FINISHED_STOPPED, "stop": RequestStatus.FINISHED_STOPPED}
    _, ups = run(s)
    done = {u.request_id: u.status for u in ups if u.finished}
    assert done == {
        "len": RequestStatus.FINISHED_LENGTH_CAPPED,
        "min": RequestStatus.FINISHED_STOPPED,
    }
    assert not s.has_unfinished() and s.kv.num_free_blocks == 19


def test_ignore_eos():
    s = make()
    s.add_request(req("a", 3, max_tokens=3, eos=7, ignore_eos=True))
    for _ in range(3):
        run(s)
    assert not s.has_unfinished()


def test_preemption_by_recompute_and_resume():
    # 6 usable blocks of 4 tokens. a and b take 2 blocks each for 8-token prompts.
    s = make(num_blocks=7, budget=64, caching=False)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    run(s)
    assert s.kv.get_block_ids("a") == [1, 2] and s.kv.get_block_ids("b") == [3, 4]
    run(s)  # positions 8 -> blocks 5 (a), 6 (b)
    assert s.kv.num_free_blocks == 0
    for _ in range(3):  # positions 9, 10, 11 fit in the blocks held
        out, _ = run(s)
        assert out.preempted_ids == []
    out, _ = run(s)  # a needs a block for position 12: b (latest arrival) is preempted
    assert out.preempted_ids == ["b"] and sizes(out) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert s.num_preemptions == 1 and b.num_computed_tokens == 0
    assert s.kv.get_block_ids("b") == []
    # finishing a lets b back in; it recomputes prompt + its generated tokens
    while a.status is RequestStatus.RUNNING:
        run(s)
    resumed_tokens = b.prompt_token_ids + b.output_token_ids
    assert len(resumed_tokens) == 13  # 8 prompt + 5 generated before preemption
    out, _ = run(s)
    assert sizes(out) == {"b": 13} and out.chunks[0].token_ids == resumed_tokens
    # b's preemption freed 6 4 3 (tail first; a then took 3), a's end freed 3 5 2 1: the
    # last freed is handed out first
    assert out.chunks[0].samples and s.kv.get_block_ids("b") == [1, 2, 5, 3]


def test_preemption_returns_budget_and_reports_ids():
    s = make(num_blocks=4, budget=64, caching=False)
    s.add_request(req("a", 4, max_tokens=20, t=0))
    s.add_request(req("b", 4, max_tokens=20, t=1))
    run(s)  # a: [1], b: [2]
    out, _ = run(s)  # position 4: a takes block 3; b finds none and preempts itself
    assert out.preempted_ids == ["b"] and sizes(out) == {"a": 1}
    assert s.requests["b"].status is RequestStatus.PREEMPTED
    assert s.kv.get_block_ids("a") == [1, 3] and s.kv.get_block_ids("b") == []
    assert s.waiting[0].request_id == "b"


def test_priority_policy_orders_admission_and_preempts_lowest():
    s = make(max_seqs=1, policy="priority")
    s.add_request(req("low", 2, priority=5, t=0))
    s.add_request(req("high", 2, priority=0, t=1))
    out, _ = run(s)
    assert sizes(out) == {"high": 2}
    s2 = make(num_blocks=4, budget=64, policy="priority", caching=False)
    s2.add_request(req("low", 4, max_tokens=20, priority=5, t=0))
    s2.add_request(req("high", 4, max_tokens=20, priority=0, t=1))
    run(s2)
    out, _ = run(s2)  # both need a block at position 4; only one is left: low is preempted
    assert out.preempted_ids == ["low"] and sizes(out) == {"high": 1}


def test_prefix_cache_hit_counts_cached_tokens():
    s = make(budget=64)
    s.add_request(req("a", 9, max_tokens=1))
    run(s)
    s.add_request(req("b", 9, max_tokens=1))
    out, _ = run(s)
    # 9 tokens: 2 full blocks (8 tokens) cached by a; b computes only its last token
    assert sizes(out) == {"b": 1} and out.chunks[0].start_pos == 8
    assert s.requests.get("b") is None  # finished after one token


def test_abort_frees_and_reports():
    s = make()
    s.add_request(req("a", 5))
    run(s)
    s.abort_request("a")
    assert s.kv.num_free_blocks == 19
    out = s.schedule()
    assert out.is_empty and out.finished_ids == ["a"]


def test_aborted_during_step_is_ignored():
    s = make()
    s.add_request(req("a", 5))
    out = s.schedule()
    s.abort_request("a")
    assert s.update_from_output(out, {"a": SampledTokens([1])}) == []


def test_speculative_tokens_scheduled_and_rolled_back():
    s = make(budget=64)
    r = req("a", 4, max_tokens=10)
    s.add_request(r)
    run(s)  # prompt; samples 7
    r.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    c = out.chunks[0]
    assert c.token_ids == [7, 8, 9, 10] and c.num_spec_tokens == 3 and c.start_pos == 4
    # target accepted 8 and then sampled 11 instead of 9
    ups = s.update_from_output(out, {"a": SampledTokens([8, 11])})
    assert ups[0].new_token_ids == [8, 11]
    assert r.output_token_ids == [7, 8, 11] and r.num_computed_tokens == 6
    assert r.spec_token_ids == []


def test_prefill_cap_while_decoding_spreads_prompts_over_decode_steps():
    s = make(num_blocks=40, budget=16, cap=5, caching=False)
    s.add_request(req("a", 3, max_tokens=10))
    out, _ = run(s)
    assert sizes(out) == {"a": 3}  # nothing decodes yet: the prompt may take the whole budget
    s.add_request(req("b", 12, max_tokens=10))
    s.add_request(req("c", 4, max_tokens=10))
    out, _ = run(s)
    assert sizes(out) == {"a": 1, "b": 5}  # a decodes: prompts share 5 tokens
    out, _ = run(s)
    assert sizes(out) == {"a": 1, "b": 5}  # b's running chunk is capped too; c waits
    out, _ = run(s)
    assert sizes(out) == {"a": 1, "b": 2, "c": 3}  # b's last 2, then c within the same 5
    assert [c.samples for c in out.chunks] == [True, True, False]
    out, _ = run(s)
    assert sizes(out) == {"a": 1, "b": 1, "c": 1}


def test_prefill_cap_off_and_without_decodes_keeps_the_budget():
    for cap in (None, 4):
        s = make(num_blocks=40, budget=16, cap=cap, caching=False)
        s.add_request(req("x", 10))
        s.add_request(req("y", 10))
        out, _ = run(s)
        assert sizes(out) == {"x": 10, "y": 6}
    # no cap: decodes leave the rest of the budget to prompts
    s = make(num_blocks=40, budget=16, caching=False)
    assert prompt_beside_a_decode(s, 20) == {"a": 1, "b": 15}


def prompt_beside_a_decode(s, prompt_len):
    """The step's sizes once request "a" decodes and a prompt "b" of prompt_len arrives."""
    s.add_request(req("a", 2, max_tokens=10))
    run(s)
    s.add_request(req("b", prompt_len))
    out, _ = run(s)
    return sizes(out)


def test_prefill_cap_never_holds_back_a_prompt_that_cannot_be_chunked():
    s = make(num_blocks=40, budget=16, caching=False, cap=4, chunked=False)
    assert prompt_beside_a_decode(s, 10) == {"a": 1, "b": 10}


def test_prefill_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 1"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0)
