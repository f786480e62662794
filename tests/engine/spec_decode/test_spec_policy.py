"""When not to speculate: exact decisions of the policy."""

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.spec_decode.policy import COST_MARGIN, SpeculationPolicy, StepCost


def decoding(rid, prompt_len=10, num_output=1, max_tokens=100):
    r = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    r.output_token_ids = [5] * num_output
    r.num_computed_tokens = r.num_tokens - 1
    return r


def policy(**kw):
    cfg = dict(num_speculative_tokens=4, max_batch_for_speculation=2, min_expected_accepted=2.0)
    cfg.update(kw)
    return SpeculationPolicy(SpeculativeConfig(**cfg), max_model_len=50)


def test_large_batches_do_not_speculate():
    p = policy()
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    assert p.plan([a, b]) == [(a, 4), (b, 4)]
    assert p.plan([a, b, c]) == []
    assert p.step == 2


def test_k_is_capped_by_tokens_left():
    p = policy(max_batch_for_speculation=8)
    near_max_tokens = decoding("t", num_output=7, max_tokens=10)  # may emit 3: k <= 2
    last_token = decoding("u", num_output=9, max_tokens=10)  # may emit 1: no speculation
    near_model_len = decoding("m", prompt_len=46, num_output=1)  # 47 tokens of 50: k <= 2
    assert p.plan([near_max_tokens, last_token, near_model_len]) == [
        (near_max_tokens, 2),
        (near_model_len, 2),
    ]


def test_low_acceptance_backs_off_then_probes():
    # k = 4, min_expected_accepted = 2: threshold rate 0.5; alpha 0.5
    p = policy(backoff_steps=3, acceptance_ema_alpha=0.5)
    a = decoding("a")
    assert p.plan([a]) == [(a, 4)]  # step 1
    p.observe("a", 4, 1)  # EMA 1 -> 0.625
    assert p.ema["a"] == 0.625
    assert p.plan([a]) == [(a, 4)]  # step 2
    p.observe("a", 4, 0)  # 0.3125 < 0.5: back off for steps 3, 4, 5; EMA restarts at 0.5
    assert p.ema["a"] == 0.5 and p.resume_step["a"] == 6
    assert [p.plan([a]) for _ in range(3)] == [[], [], []]
    assert p.plan([a]) == [(a, 4)]  # step 6: the probe
    p.observe("a", 4, 2)  # rate 0.5 = threshold: keeps speculating
    assert p.ema["a"] == 0.5 and p.plan([a]) == [(a, 4)]
    p.observe("a", 4, 1)  # rate 0.25 < threshold: backs off again (its last probe passed)
    assert p.resume_step["a"] == 7 + 3 + 1 and p.plan([a]) == []
    assert [p.plan([a]) for _ in range(2)] == [[], []]
    assert p.plan([a]) == [(a, 4)]  # step 11: the probe
    p.observe("a", 4, 0)  # fails: a second back-off in a row waits twice as long
    assert p.resume_step["a"] == 11 + 6 + 1
    p.forget("a")
    assert "a" not in p.ema
    # what recent verifications accepted (0.36 here) is below the threshold: a new request
    # starts backed off, its first probe backoff_steps later
    assert p.recent_rate < p.threshold_rate
    fresh = decoding("fresh")
    assert p.plan([fresh]) == [] and p.resume_step["fresh"] == p.step + 3
    for _ in range(5):
        p.observe("x", 4, 4)  # recent rate 0.23 -> 0.54 >= 0.5: new requests speculate at once
    new = decoding("new")
    assert p.plan([new]) == [(new, 4)]


def test_other_requests_keep_speculating_while_one_backs_off():
    p = policy(backoff_steps=5, acceptance_ema_alpha=1.0)
    a, b = decoding("a"), decoding("b")
    p.plan([a, b])
    p.observe("a", 4, 0)
    p.observe("b", 4, 4)
    assert p.plan([a, b]) == [(b, 4)]


def test_step_cost_fits_requests_and_verifications():
    cost = StepCost()
    for n in (4, 3, 2, 1) * 4:
        cost.observe(n, 0, 0.016 + 0.001 * n)
    assert cost.fit is None  # no verification seen: its cost unknown
    # 16 ms + 1 ms a request + 3 ms a verifying one
    for n, verifying in ((4, 4), (4, 0), (3, 2), (2, 0), (4, 1), (1, 0), (3, 3), (1, 1)):
        cost.observe(n, verifying, 0.016 + 0.001 * n + 0.003 * verifying)
    fixed, per_request, per_verification = cost.fit
    assert abs(fixed - 0.016) < 1e-6 and abs(per_request - 0.001) < 1e-6
    assert abs(per_verification - 0.003) < 1e-6
    assert abs(cost.seconds(4) - 0.020) < 1e-6


def test_the_threshold_is_the_measured_marginal_cost_of_a_draft():
    """16 ms + 1 ms a request + 6 ms a verification (k = 4 drafts): at n = 4 a plain step is
    20 ms and a draft costs 1.5 ms where a plain step's token costs 5: speculation pays above
    4 x 1.5 / 20 = 0.3 (x the margin); at n = 1 the floor (min_expected_accepted / k) rules.
    The proposer's time counts too; where even all-accepted drafts cannot pay, nobody
    proposes."""
    p = policy(max_batch_for_speculation=8, min_expected_accepted=0.6)  # floor 0.15
    requests = [decoding(str(i)) for i in range(4)]
    p.plan(requests)
    assert p.threshold_rate == 0.15  # nothing measured yet
    steps = ((4, 0), (4, 3), (3, 1), (4, 2), (2, 0), (3, 0), (1, 1), (1, 0))
    for n, verifying in steps * 2:
        p.observe_step(n, verifying, 0.016 + 0.001 * n + 0.006 * verifying)
    p.plan(requests)
    threshold = COST_MARGIN * 4 * 0.0015 / 0.020
    assert abs(p.threshold_rate - threshold) < 1e-6
    p.plan(requests[:1])
    assert p.threshold_rate == 0.15  # 1.3 x 1 x 1.5 ms / 17 ms = 0.115 < the floor
    p.observe_proposer(num_drafts=4, seconds=0.004)  # EMA (alpha 0.3) of 1 ms a draft
    p.plan(requests)
    threshold = COST_MARGIN * 4 * (0.0015 + 0.0003) / 0.020
    assert abs(p.threshold_rate - threshold) < 1e-6
    p.observe("0", 4, 4)  # rate EMA stays 1: speculating
    p.observe("1", 4, 0)  # EMA 0.7 > 0.468: still on
    assert p.plan(requests) == [(r, 4) for r in requests]
    p.observe("1", 4, 0)  # 0.49 > 0.468 ... then 0.343 < it: backs off
    p.observe("1", 4, 0)
    assert [r for r, _ in p.plan(requests)] == [requests[0], requests[2], requests[3]]
    for n, verifying in steps * 32:  # a verification now costs more than a plain step
        p.observe_step(n, verifying, 0.002 + 0.001 * n + 0.03 * verifying)
    assert p.plan(requests) == [] and p.threshold_rate >= 1  # nobody proposes
