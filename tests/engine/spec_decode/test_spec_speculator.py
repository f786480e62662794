"""The speculator's bookkeeping around real scheduler steps (scripted proposer, no model):
metrics counted exactly, proposer rolled back and freed at the right moments."""

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.outputs import SampledTokens
from pdserve.engine.spec_decode.proposer import Proposal
from pdserve.engine.spec_decode.speculator import Speculator
from tests.engine.test_scheduler import make, req


class ScriptedProposer:
    """Proposes what the test put in .drafts; records every call."""

    def __init__(self):
        self.drafts: dict[str, list[int]] = {}
        self.calls: list[tuple] = []

    def propose(self, requests):
        self.calls.append(("propose", [(r.request_id, k) for r, k in requests]))
        return {
            r.request_id: Proposal(self.drafts.pop(r.request_id)[:k])
            for r, k in requests
            if r.request_id in self.drafts
        }

    def rollback(self, request_id, num_tokens):
        self.calls.append(("rollback", request_id, num_tokens))

    def free(self, request_id):
        self.calls.append(("free", request_id))


def setup(**kw):
    cfg = SpeculativeConfig(
        num_speculative_tokens=3, max_batch_for_speculation=8, min_expected_accepted=0.0, **kw
    )
    scheduler = make(num_blocks=40, block_size=4, budget=64)
    proposer = ScriptedProposer()
    return scheduler, proposer, Speculator(cfg, proposer, max_model_len=1000)


def step(scheduler, spec, results):
    """One engine step with the model's results scripted: request id -> tokens."""
    spec.propose(scheduler.running)
    out = scheduler.schedule()
    spec.after_schedule(out)
    sampled = {c.request_id: SampledTokens(results[c.request_id]) for c in out.chunks if c.samples}
    updates = scheduler.update_from_output(out, sampled)
    spec.after_step(out, sampled, updates)
    assert all(not r.spec_token_ids for r in scheduler.requests.values())
    return out, updates


def test_metrics_rollbacks_and_frees_in_a_scripted_run():
    s, proposer, spec = setup()
    s.add_request(req("a", 4, max_tokens=20))
    s.add_request(req("b", 4, max_tokens=20, stop_token_ids=[50]))
    step(s, spec, {"a": [7], "b": [7]})  # prefill: nobody is decoding yet
    assert proposer.calls == [] and spec.stats.num_drafts == 0

    proposer.drafts = {"a": [8, 9, 10], "b": [11, 12, 13]}
    out, _ = step(s, spec, {"a": [8, 9, 99], "b": [21]})  # a: 2 accepted, b: none
    assert [c.num_spec_tokens for c in out.chunks] == [3, 3]
    assert proposer.calls[-3:] == [
        ("propose", [("a", 3), ("b", 3)]),
        ("rollback", "a", 5 + 2),  # 5 tokens when proposed + 2 accepted
        ("rollback", "b", 5),
    ]
    stats = spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]

    proposer.drafts = {"a": [1, 2, 3], "b": [50, 5, 6]}
    _, updates = step(s, spec, {"a": [1, 2, 3, 4], "b": [50, 60]})  # b stops on 50 mid-run
    assert {u.request_id: u.new_token_ids for u in updates} == {"a": [1, 2, 3, 4], "b": [50]}
    assert proposer.calls[-3:] == [
        ("rollback", "a", 8 + 3),
        ("rollback", "b", 6 + 1),
        ("free", "b"),
    ]
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 12, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert stats.acceptance_rate == 0.5 and stats.mean_acceptance_length == 2.5
    assert "b" not in spec.policy.ema

    s.abort_request("a")  # reported by the next schedule(): freed then
    step(s, spec, {})
    assert proposer.calls[-1] == ("free", "a")


def test_unverified_drafts_are_dropped_and_rolled_back():
    s, proposer, spec = setup()
    s.add_request(req("a", 4, max_tokens=20))
    step(s, spec, {"a": [7]})
    s.config = type(s.config)(max_num_seqs=8, max_num_batched_tokens=1)  # no budget for drafts
    proposer.drafts = {"a": [8, 9, 10]}
    out, _ = step(s, spec, {"a": [30]})
    assert out.chunks[0].num_spec_tokens == 0
    assert proposer.calls[-1] == ("rollback", "a", 5)
    assert spec.stats.num_drafts == 0 and spec.policy.ema["a"] == 1.0  # nothing observed


def test_preempted_requests_are_freed_and_keep_their_policy_state():
    s, proposer, spec = setup()
    s.kv = type(s.kv)(num_blocks=4, block_size=4, enable_caching=False)  # 3 usable blocks
    s.add_request(req("a", 4, max_tokens=20, t=0))
    s.add_request(req("b", 4, max_tokens=20, t=1))
    step(s, spec, {"a": [7], "b": [7]})
    spec.policy.ema["b"] = 0.9
    out, _ = step(s, spec, {"a": [8]})  # position 4: a takes the last block, b preempts itself
    assert out.preempted_ids == ["b"] and ("free", "b") in proposer.calls
    assert spec.policy.ema["b"] == 0.9
