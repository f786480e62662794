"""logit_bias, allowed_token_ids and bad words in the batched sampler: exact effects per row,
rows without them untouched, random rows and logprobs (raw) included."""

import pytest
import torch

from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import SamplingMetadata, compute_probs, process_logits
from tests.engine.test_sampler import make_row, sample

INF = float("inf")
LOGITS = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


def test_logit_bias_adds_to_exact_tokens_of_its_row_only() -> None:
    rows = [make_row(greedy(logit_bias={3: 10.0, 0: -1.5})), make_row(greedy())]
    meta = SamplingMetadata.build(rows, 5)
    out = process_logits(LOGITS.expand(2, 5).clone(), meta)
    assert out[0].tolist() == [3.5, 4.0, 3.0, 12.0, 1.0]
    assert out[1].tolist() == LOGITS[0].tolist()
    assert sample(LOGITS.expand(2, 5), rows).token_ids == [3, 0]


def test_logit_bias_minus_100_bans_a_token_for_random_rows() -> None:
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0})
    rows = [make_row(params, seed=s) for s in range(64)]
    assert not {0, 1} & set(sample(LOGITS.expand(64, 5), rows).token_ids)


def test_allowed_token_ids_restrict_only_their_row() -> None:
    rows = [
        make_row(greedy(allowed_token_ids=(2, 4))),
        make_row(greedy()),
        make_row(greedy(allowed_token_ids=(4,))),
    ]
    meta = SamplingMetadata.build(rows, 5)
    out = process_logits(LOGITS.expand(3, 5).clone(), meta)
    assert out[0].tolist() == [-INF, -INF, 3.0, -INF, 1.0]
    assert out[1].tolist() == LOGITS[0].tolist()
    assert out[2].tolist() == [-INF, -INF, -INF, -INF, 1.0]
    probs = compute_probs(LOGITS.expand(3, 5), meta)
    assert probs.argmax(dim=-1).tolist() == [2, 0, 4]
    random_rows = [make_row(SamplingParams(allowed_token_ids=(1, 3)), seed=s) for s in range(64)]
    assert set(sample(LOGITS.expand(64, 5), random_rows).token_ids) == {1, 3}


def test_bad_words_single_token_always_and_multi_token_after_its_prefix() -> None:
    words = ((0,), (2, 1))  # never 0; never 1 right after 2
    assert sample(LOGITS, [make_row(greedy(bad_words_token_ids=words))]).token_ids == [1]
    after_prefix = make_row(greedy(bad_words_token_ids=words), output=(3, 2))
    assert sample(LOGITS, [after_prefix]).token_ids == [2]
    prefix_not_at_end = make_row(greedy(bad_words_token_ids=words), output=(2, 3))
    assert sample(LOGITS, [prefix_not_at_end]).token_ids == [1]
    # The prompt does not count: vLLM matches bad words against the output only.
    in_prompt = make_row(greedy(bad_words_token_ids=((2, 1),)), prompt=(2,))
    meta = SamplingMetadata.build([in_prompt], 5)
    assert meta.bad_words_mask is None


def test_logprobs_stay_raw_under_constraints() -> None:
    params = greedy(logit_bias={4: 50.0}, logprobs=1)
    out = sample(LOGITS, [make_row(params)])
    assert out.token_ids == [4]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 4].item())
    assert out.logprobs[0].rank == 5


def test_nothing_built_when_unused() -> None:
    meta = SamplingMetadata.build([make_row(greedy())], 5)
    assert meta.allowed is None and meta.bad_words_mask is None and meta.logit_bias is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"allowed_token_ids": ()},
        {"allowed_token_ids": (-3,)},
        {"bad_words_token_ids": ((),)},
    ],
)
def test_invalid_constraints_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
