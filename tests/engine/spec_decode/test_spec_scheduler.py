"""Speculative verification inside the unified scheduler (no model): exact block accounting
after rejection, stops landing mid-run, drafts never causing a preemption."""

from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import RequestStatus
from tests.engine.test_scheduler import make, req, run


def prefilled(s, n, **kw):
    """A request whose n-token prompt is computed and first token (7) sampled."""
    r = req("a", n, **kw)
    s.add_request(r)
    run(s)
    return r


def test_rejected_drafts_blocks_are_freed_tail_first():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 4, max_tokens=20)  # prompt in block 1; token 7 goes to position 4
    assert s.kv.get_block_ids("a") == [1] and s.kv.num_free_blocks == 18
    r.spec_token_ids = [8, 9, 10, 11, 12, 13, 14]
    out = s.schedule()
    # positions 4..11 (1 + 7 tokens): two more blocks
    assert out.chunks[0].num_spec_tokens == 7 and out.chunks[0].block_ids == [1, 2, 3]
    s.update_from_output(out, {"a": SampledTokens([8, 9, 20])})  # 2 accepted, then 20
    # tokens: 4 prompt + [7 8 9 20] = 8, computed 7; position 7 (20) is in block 2
    assert r.num_tokens == 8 and r.num_computed_tokens == 7
    assert s.kv.get_block_ids("a") == [1, 2] and s.kv.num_free_blocks == 17
    assert s.kv.pool.free_block_ids()[0] == 3  # freed (no hash): handed out next
    # all rejected: only the correction's position 8 is new -> block 3 again
    r.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.chunks[0].token_ids == [20, 1, 2, 3] and out.chunks[0].start_pos == 7
    assert out.chunks[0].block_ids == [1, 2, 3]  # positions 8..10
    s.update_from_output(out, {"a": SampledTokens([21])})
    assert r.num_tokens == 9 and s.kv.get_block_ids("a") == [1, 2, 3]
    s.update_from_output(s.schedule(), {"a": SampledTokens([22])})  # plain step: no trim
    assert s.kv.get_block_ids("a") == [1, 2, 3] and s.kv.num_free_blocks == 16


def test_all_accepted_keeps_exactly_the_blocks_the_tokens_need():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 3, max_tokens=20)
    r.spec_token_ids = [8, 9, 10, 11, 12]  # positions 3..8 -> blocks 1, 2, 3
    out = s.schedule()
    assert out.chunks[0].block_ids == [1, 2, 3]
    s.update_from_output(out, {"a": SampledTokens([8, 9, 10, 11, 12, 30])})
    # 3 + 1 + 5 + 1 = 10 tokens, 9 computed: positions 0..9 need blocks 1, 2, 3
    assert r.num_tokens == 10 and r.num_computed_tokens == 9
    assert s.kv.get_block_ids("a") == [1, 2, 3] and s.kv.num_free_blocks == 16


def test_stop_token_mid_run_ends_the_request_and_drops_the_rest():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 4, max_tokens=20, stop_token_ids=[9])
    r.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    (update,) = s.update_from_output(out, {"a": SampledTokens([8, 9, 10, 11])})
    assert update.new_token_ids == [8, 9] and update.finished
    assert update.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [7, 8, 9] and s.kv.num_free_blocks == 19


def test_eos_before_min_tokens_does_not_stop_mid_run():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 4, max_tokens=20, eos=9, min_tokens=3)
    r.spec_token_ids = [9, 9, 9]
    (update,) = s.update_from_output(s.schedule(), {"a": SampledTokens([9, 9, 9, 5])})
    # outputs 7 9 | 9 9: the 2nd output is below min_tokens; the 3rd (9) stops
    assert update.new_token_ids == [9, 9] and update.finished
    assert r.output_token_ids == [7, 9, 9]


def test_max_tokens_mid_run_caps_the_request():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 4, max_tokens=3)
    r.spec_token_ids = [8, 9, 10]
    (update,) = s.update_from_output(s.schedule(), {"a": SampledTokens([8, 9, 10, 11])})
    assert update.new_token_ids == [8, 9]
    assert update.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv.num_free_blocks == 19 and not s.has_unfinished()


def test_budget_truncates_drafts():
    s = make(num_blocks=20, block_size=4, budget=64)
    r = prefilled(s, 4, max_tokens=20)
    s.config = type(s.config)(max_num_seqs=8, max_num_batched_tokens=3)
    r.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    assert out.chunks[0].token_ids == [7, 8, 9] and out.chunks[0].num_spec_tokens == 2
    assert out.num_batched_tokens == 3


def test_drafts_never_take_a_plain_decode_step():
    # budget 4, two decoding requests with 3 drafts each: both decode, drafts get the rest
    s = make(num_blocks=20, block_size=4, budget=64)
    a = req("a", 4, max_tokens=20, t=0)
    b = req("b", 4, max_tokens=20, t=1)
    s.add_request(a)
    s.add_request(b)
    run(s)
    s.config = type(s.config)(max_num_seqs=8, max_num_batched_tokens=4)
    a.spec_token_ids = [8, 9, 10]
    b.spec_token_ids = [11, 12, 13]
    out = s.schedule()
    chunks = {c.request_id: c for c in out.chunks}
    assert chunks["a"].token_ids == [7, 8, 9] and chunks["a"].num_spec_tokens == 2
    assert chunks["b"].token_ids == [7] and chunks["b"].num_spec_tokens == 0
    assert out.num_batched_tokens == 4
    # the step folds back as usual: a accepts one draft, b samples its next token
    s.update_from_output(out, {"a": SampledTokens([8, 5]), "b": SampledTokens([6])})
    assert a.output_token_ids == [7, 8, 5] and b.output_token_ids == [7, 6]
    assert a.num_computed_tokens == 6 and b.num_computed_tokens == 5


def test_drafts_without_room_are_dropped_instead_of_preempting():
    # 3 usable blocks: a (prompt 3) holds block 1, b (prompt 7) holds 2 and 3
    s = make(num_blocks=4, block_size=4, budget=64, caching=False)
    a = req("a", 3, max_tokens=20, t=0)
    b = req("b", 7, max_tokens=20, t=1)
    s.add_request(a)
    s.add_request(b)
    run(s)
    assert s.kv.num_free_blocks == 0
    a.spec_token_ids = [8]  # position 3 fits block 1, the draft's position 4 would not
    out = s.schedule()
    assert out.preempted_ids == [] and a.spec_token_ids == []
    chunk = next(c for c in out.chunks if c.request_id == "a")
    assert chunk.token_ids == [7] and chunk.num_spec_tokens == 0
