"""When not to speculate: exact decisions of the policy."""

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.spec_decode.policy import SpeculationPolicy


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
    p.observe("a", 4, 1)  # rate 0.25 < threshold: backs off again
    assert p.resume_step["a"] == 7 + 3 + 1 and p.plan([a]) == []
    p.forget("a")
    assert p.plan([a]) == [(a, 4)] and "a" not in p.ema


def test_other_requests_keep_speculating_while_one_backs_off():
    p = policy(backoff_steps=5, acceptance_ema_alpha=1.0)
    a, b = decoding("a"), decoding("b")
    p.plan([a, b])
    p.observe("a", 4, 0)
    p.observe("b", 4, 4)
    assert p.plan([a, b]) == [(b, 4)]
