"""The rejection sampler on hand-made target logits and draft distributions: greedy exactness,
every position's distribution is the plain sampler's, the output distribution equals p."""

from __future__ import annotations

import math
from collections import Counter

import torch

from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import (
    DRAFT_STREAM,
    Sampler,
    SampleRow,
    SamplingMetadata,
    compute_probs,
    random_sample,
)
from pdserve.engine.spec_decode.rejection_sampler import (
    DraftsToVerify,
    RejectionSampler,
    expand_rows,
)
from tests.engine.spec_decode.stats import goodness_of_fit

GREEDY = SamplingParams(temperature=0.0)


def make_row(params, seed=0, position=3, output=(7,), eos=()):
    return SampleRow(params, seed, position, [1, 2], list(output), eos)


def one_hot_logits(argmaxes, vocab=8):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_expand_rows_extends_output_and_position_per_draft():
    rows = expand_rows(DraftsToVerify(make_row(GREEDY, position=3), [4, 5], None))
    assert [r.position for r in rows] == [3, 4, 5]
    assert [list(r.output_token_ids) for r in rows] == [[7], [7, 4], [7, 4, 5]]


def test_greedy_accepts_while_argmax_agrees_then_emits_it():
    # target argmax at the four positions of each request: 2 4 1 3
    logits = torch.cat([one_hot_logits([2, 4, 1, 3])] * 3 + [one_hot_logits([6, 0])])
    q = torch.full((3, 8), 1 / 8)  # a draft model's q: ignored by greedy rows
    items = [
        DraftsToVerify(make_row(GREEDY), [2, 4, 0], None),  # third draft wrong
        DraftsToVerify(make_row(GREEDY), [2, 4, 1], q),  # all right: bonus
        DraftsToVerify(make_row(GREEDY), [5, 4, 1], None),  # first wrong
        DraftsToVerify(make_row(GREEDY), [6], None),  # k = 1, right
    ]
    out = RejectionSampler()(logits, items)
    assert [o.token_ids for o in out] == [[2, 4, 1], [2, 4, 1, 3], [2], [6, 0]]
    assert all(o.logprobs is None for o in out)


def test_each_position_sees_the_drafts_before_it():
    """min_tokens masks eos while output + drafts before it are short; a repetition penalty
    counts the drafts before it. Greedy result = the plain Sampler's, row by row."""
    eos = 3
    logits = torch.tensor([[0.0, 0, 0, 9, 5, 4, 0, 0]] * 4)  # eos, then 4, then 5
    params = SamplingParams(temperature=0.0, min_tokens=3, repetition_penalty=4.0)
    item = DraftsToVerify(make_row(params, output=(7,), eos=(eos,)), [4, 5, 3], None)
    out = RejectionSampler()(logits, [item])[0]
    # Position 0: output [7] (< 3 tokens) masks eos -> 4. Position 1: [7 4]: masked, and 4
    # penalised to 1.25 -> 5. Position 2: [7 4 5]: eos allowed -> eos. Bonus after [7 4 5 3]:
    # eos penalised to 2.25 still beats 4 (1.25) and 5 (1.0).
    expected = []
    for row in expand_rows(item):
        meta = SamplingMetadata.build([row], 8)
        expected.append(Sampler()(logits[:1], meta).token_ids[0])
    assert expected == [4, 5, 3, 3]
    assert out.token_ids == expected


def test_logprobs_come_from_the_raw_target_logits_at_each_position():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    drafts = [argmax[0], argmax[1], (argmax[2] + 1) % 8]
    out = RejectionSampler()(logits, [DraftsToVerify(make_row(params), drafts, None)])[0]
    assert out.token_ids == argmax[:3]
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.token_id == token and lp.rank == 1
        assert math.isclose(lp.logprob, float(reference[i, token]), abs_tol=1e-5)
        assert list(lp.top) == reference[i].topk(2).indices.tolist()


def draw(probs: torch.Tensor, seeds: torch.Tensor, position: int) -> torch.Tensor:
    return random_sample(probs, seeds, torch.full_like(seeds, position), DRAFT_STREAM)


def run_many(params, logits, q, n, k=2):
    """n requests (seeds 0..n-1), identical logits [k + 1, V]; drafts drawn from q [k, V]
    (None: the one-hot draft 0, 1, ...)."""
    seeds = torch.arange(n)
    if q is None:
        drafts = [list(range(k))] * n
    else:
        drafts = torch.stack([draw(q[i], seeds, 3 + i) for i in range(k)], dim=1).tolist()
    items = [
        DraftsToVerify(make_row(params, seed=s), d, q)
        for s, d in zip(range(n), drafts, strict=True)
    ]
    out = RejectionSampler()(logits.repeat(n, 1), items)
    return drafts, [o.token_ids for o in out]


def target_probs(params, logits, i):
    return compute_probs(logits[i : i + 1], SamplingMetadata.build([make_row(params)], 8))[0]


def test_sampled_output_is_distributed_as_p_for_a_draft_model_q():
    n = 8000
    logits = torch.tensor(
        [[2.0, 1.5, 1.0, 0.5, 0.0, -1, -2, -9], [0.0, 2.0, 0.3, 1.0, 0.2, 0.1, -1, -2], [0.0] * 8]
    )
    q = torch.tensor(
        [[0.05, 0.05, 0.3, 0.3, 0.2, 0.05, 0.05, 0.0], [0.3, 0.1, 0.1, 0.1, 0.2, 0.1, 0.05, 0.05]]
    )
    assert torch.allclose(q.sum(dim=-1), torch.ones(2))
    params = SamplingParams(temperature=1.0)
    drafts, outputs = run_many(params, logits, q, n)
    p0, p1 = target_probs(params, logits, 0), target_probs(params, logits, 1)
    first = Counter(o[0] for o in outputs)
    assert goodness_of_fit(first, dict(enumerate(p0.tolist())), n) > 1e-3
    # the test has power: the drafts themselves (drawn from q) are far from p0
    assert goodness_of_fit(Counter(d[0] for d in drafts), dict(enumerate(p0.tolist())), n) < 1e-9
    # a second token is emitted iff the first draft was accepted: P = sum(min(p0, q0))
    seconds = [o[1] for o in outputs if len(o) > 1]
    accept_rate = float(torch.minimum(p0, q[0]).sum())
    assert abs(len(seconds) / n - accept_rate) < 4 * math.sqrt(accept_rate / n)
    assert goodness_of_fit(Counter(seconds), dict(enumerate(p1.tolist())), len(seconds)) > 1e-3
    bonuses = [o[2] for o in outputs if len(o) > 2]  # both accepted: the bonus is from p2
    p2 = target_probs(params, logits, 2)
    assert goodness_of_fit(Counter(bonuses), dict(enumerate(p2.tolist())), len(bonuses)) > 1e-3


def test_sampled_output_with_top_p_and_one_hot_drafts_is_distributed_as_p():
    """n-gram: q is one-hot at drafts 0, 1. Temperature and top-p shape p."""
    n = 8000
    logits = torch.tensor([[1.0, 2.0, 1.5, 0.5, 0.0, -1, 0.2, 0.1]] * 3)
    params = SamplingParams(temperature=0.8, top_p=0.8)
    _, outputs = run_many(params, logits, None, n)
    p0 = target_probs(params, logits, 0)
    assert float(p0[4]) == 0.0 and float(p0[0]) > 0  # top-p dropped the tail
    first = Counter(o[0] for o in outputs)
    assert goodness_of_fit(first, dict(enumerate(p0.tolist())), n) > 1e-3
    # draft 0 is accepted with probability p0(0)
    accepted = sum(1 for o in outputs if len(o) > 1)
    assert abs(accepted / n - float(p0[0])) < 4 * math.sqrt(float(p0[0]) / n)


def test_reproducible_from_seed_and_position():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    q = torch.softmax(torch.randn(2, 8, generator=torch.Generator().manual_seed(2)), dim=-1)
    params = SamplingParams(temperature=1.0)
    _, once = run_many(params, logits, q, 200)
    _, again = run_many(params, logits, q, 200)
    assert once == again and len({tuple(o) for o in once}) > 20
