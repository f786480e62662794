import math

import pytest
import torch

from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import (
    Sampler,
    SampleRow,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_probs,
    uniform_noise,
)

INF = float("inf")


def make_row(
    params: SamplingParams,
    seed: int = 0,
    position: int = 0,
    prompt: tuple[int, ...] = (0,),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
) -> SampleRow:
    return SampleRow(params, seed, position, list(prompt), list(output), eos)


def sample(logits: torch.Tensor, rows: list[SampleRow]):
    return Sampler()(logits, SamplingMetadata.build(rows, logits.shape[-1]))


# --- the noise ------------------------------------------------------------------------------

M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def reference_uniform(seed: int, position: int, column: int, stream: int) -> float:
    """uniform_noise in plain Python integers."""

    def splitmix64(x: int) -> int:
        x &= M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    def lowbias32(x: int) -> int:
        x &= M32
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
        x = ((x ^ (x >> 15)) * 0x846CA68B) & M32
        return x ^ (x >> 16)

    golden = 0x9E3779B97F4A7C15
    key = splitmix64(splitmix64(seed + (stream + 1) * golden) + position * golden)
    bits = lowbias32(lowbias32(column * 0x9E3779B9 + key) ^ (key >> 32))
    return ((bits >> 9) + 0.5) * 2.0**-23


def test_uniform_noise_matches_reference_bit_for_bit() -> None:
    seeds = [0, 1, 12345, -7, (1 << 63) - 1, -(1 << 63)]
    positions = [0, 3, 1 << 20, 99, 5, 1 << 40]
    for stream in (0, 1, 7):
        noise = uniform_noise(torch.tensor(seeds), torch.tensor(positions), 37, stream)
        assert noise.dtype == torch.float32 and noise.shape == (6, 37)
        for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
            expected = [reference_uniform(seed, position, i, stream) for i in range(37)]
            assert noise[r].tolist() == expected


def test_uniform_noise_is_uniform_and_keyed() -> None:
    seeds, positions = torch.arange(64), torch.arange(64) * 3
    noise = uniform_noise(seeds, positions, 4096)
    assert 0 < noise.min() and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.002
    assert abs(noise.var().item() - 1 / 12) < 0.001
    # Every key gives another stream: seed, position and stream number all matter.
    assert not torch.equal(noise[:1], uniform_noise(seeds[:1] + 1, positions[:1], 4096))
    assert not torch.equal(noise[:1], uniform_noise(seeds[:1], positions[:1] + 1, 4096))
    assert not torch.equal(noise[:1], uniform_noise(seeds[:1], positions[:1], 4096, stream=1))
    # Wider draws extend narrower ones: column i does not depend on the width.
    assert torch.equal(uniform_noise(seeds, positions, 10), noise[:, :10])


# --- greedy and seeded sampling --------------------------------------------------------------


def test_greedy_takes_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [make_row(greedy)] * 5).token_ids == logits.argmax(-1).tolist()
    # Mixed with random rows, greedy rows still take the argmax.
    rows = [make_row(greedy if i % 2 else SamplingParams(), seed=i) for i in range(5)]
    tokens = sample(logits, rows).token_ids
    assert tokens[1::2] == logits.argmax(-1)[1::2].tolist()


def test_seeded_row_is_independent_of_batch_mates_and_order() -> None:
    gen = torch.Generator().manual_seed(1)
    mine = torch.randn(100, generator=gen)
    others = torch.randn(3, 100, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=40)
    for position in range(20):
        me = make_row(params, seed=42, position=position)
        alone = sample(mine[None], [me]).token_ids[0]
        mates = [
            make_row(SamplingParams(temperature=0)),
            make_row(SamplingParams(top_p=0.5, repetition_penalty=1.3), seed=7, position=3),
            make_row(SamplingParams(), seed=42, position=position + 1),
        ]
        first = sample(torch.cat([mine[None], others]), [me, *mates]).token_ids[0]
        last = sample(torch.cat([others, mine[None]]), [*mates, me]).token_ids[-1]
        assert alone == first == last


def generate(seed: int, num_steps: int, output: tuple[int, ...] = ()) -> list[int]:
    """A fake model whose logits depend on the last token; samples num_steps tokens."""
    table = torch.randn(32, 32, generator=torch.Generator().manual_seed(3)) * 2
    prompt = (5, 9)
    params = SamplingParams(temperature=1.0, max_tokens=64)
    tokens = list(output)
    for _ in range(num_steps):
        last = (prompt + tuple(tokens))[-1]
        row = make_row(params, seed, len(prompt) + len(tokens), prompt, tuple(tokens))
        tokens.append(sample(table[last][None], [row]).token_ids[0])
    return tokens


def test_resume_from_any_position_continues_identically() -> None:
    full = generate(seed=11, num_steps=12)
    for cut in (0, 1, 6, 11):
        assert generate(seed=11, num_steps=12 - cut, output=tuple(full[:cut])) == full


def test_different_seeds_give_different_sequences() -> None:
    sequences = {tuple(generate(seed, num_steps=10)) for seed in range(8)}
    assert len(sequences) == 8


# --- masks -----------------------------------------------------------------------------------


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > -INF).flatten().tolist() for row in logits]


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 in a shuffled order
PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = PROBS.log()[None]


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "expected"),
    [
        (2, None, None, [1, 3]),
        (3, None, None, [1, 3, 4]),
        (5, None, None, [0, 1, 2, 3, 4]),
        (None, 0.5, None, [1, 3]),  # 0.4 < 0.5 <= 0.7
        (None, 0.75, None, [1, 3, 4]),  # 0.7 < 0.75 <= 0.85
        (None, 0.3, None, [1]),
        (None, 1.0, None, [0, 1, 2, 3, 4]),
        (3, 0.8, None, [1, 3]),  # top-3 renormalised: 0.47, 0.35, 0.18
        (None, None, 0.3, [1, 3, 4]),  # keep p >= 0.12
        (None, None, 0.2, [0, 1, 3, 4]),  # keep p >= 0.08
        (None, 0.9, 0.5, [1, 3]),  # top-p keeps 4 tokens, min-p only 0.4 and 0.3
    ],
)
def test_masks_keep_expected_tokens(top_k, top_p, min_p, expected) -> None:
    def column(value, dtype):
        return None if value is None else torch.tensor([value], dtype=dtype)

    masked = apply_top_k_top_p_min_p(
        LOGITS,
        column(top_k, torch.int64),
        column(top_p, torch.float32),
        column(min_p, torch.float32),
    )
    assert kept(masked) == [expected]
    assert torch.equal(masked[0, expected], LOGITS[0, expected])  # survivors untouched


def test_masks_per_row_and_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]] * 3)
    top_k = torch.tensor([2, 5, 1])  # 5 = the vocab: keeps everything
    masked = apply_top_k_top_p_min_p(logits, top_k, None, None)
    assert kept(masked) == [[1, 2, 3], [0, 1, 2, 3, 4], [1]]  # ties at the boundary stay


def test_top_p_on_large_vocab_matches_sorted_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    # Peaked rows find the nucleus among the top candidates; flat rows need the full sort.
    logits = torch.randn(6, 3000, generator=gen) * torch.tensor(
        [[8.0], [4.0], [1.0], [0.1], [2.0], [0.01]]
    )
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.7, 1.0, 0.3])
    masked = apply_top_k_top_p_min_p(logits, None, top_p, None)
    for row, p, got in zip(logits.double(), top_p.tolist(), kept(masked), strict=True):
        probs, order = row.softmax(-1).sort(descending=True)
        mass_before = probs.cumsum(-1) - probs
        num_kept = int((mass_before < p).sum()) if p < 1 else len(row)
        assert sorted(got) == sorted(order[:num_kept].tolist())
    assert len(kept(masked)[4]) == 3000
    # Equal logits tie at the boundary, and ties are kept.
    flat = apply_top_k_top_p_min_p(torch.zeros(1, 3000), None, torch.tensor([0.3]), None)
    assert len(kept(flat)[0]) == 3000


# --- penalties and min_tokens ----------------------------------------------------------------


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 4.0, -3.0, 1.0, 0.5], [2.0, -1.0, 4.0, -3.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [
        make_row(SamplingParams()),  # no penalties: untouched
        make_row(params, prompt=(1, 4, 1), output=(2, 3, 3)),
    ]
    meta = SamplingMetadata.build(rows, 6)
    assert meta.penalties is not None
    out = apply_penalties(logits, meta.penalties)
    # Repetition over prompt+output {1, 2, 3, 4}; presence/frequency over output {2: 1, 3: 2}.
    expected = [2.0, -1.0 * 2, 4.0 / 2 - 0.5 - 0.25, -3.0 * 2 - 0.5 - 0.5, 1.0 / 2, 0.5]
    assert out[1].tolist() == expected
    assert torch.equal(out[0], logits[0])
    assert out is not logits and logits[1, 2] == 4.0  # the input is not modified


def test_greedy_sees_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    repeat = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [make_row(repeat, prompt=(1,))]).token_ids == [0]
    assert sample(logits, [make_row(repeat, prompt=(0,))]).token_ids == [1]  # 1.5 < 2
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits, [make_row(freq, output=(0,))]).token_ids == [0]  # 2.4 > 2
    assert sample(logits, [make_row(freq, output=(0, 0))]).token_ids == [1]  # 1.8 < 2


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))
    # Below min_tokens both eos (0) and the stop id (1) are masked, ignore_eos or not.
    for p in (
        params,
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,), ignore_eos=True),
    ):
        assert sample(logits, [make_row(p, output=(3,), eos=(0,))]).token_ids == [2]
    assert sample(logits, [make_row(params, output=(3, 3), eos=(0,))]).token_ids == [0]
    # ignore_eos alone masks nothing: the engine just does not stop.
    ignore = SamplingParams(temperature=0, ignore_eos=True)
    assert sample(logits, [make_row(ignore, eos=(0,))]).token_ids == [0]
    # Random rows are masked too.
    rows = [make_row(SamplingParams(min_tokens=1), seed=s, eos=(0, 1)) for s in range(50)]
    assert set(sample(logits.expand(50, 4), rows).token_ids) <= {2, 3}


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0], [0.0, 0.1, 0.2, 0.3, 0.4]])
    rows = [
        make_row(SamplingParams(temperature=0, logprobs=3, repetition_penalty=5.0), prompt=(1,)),
        make_row(SamplingParams(temperature=0)),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits[0], -1)
    first, second = out.logprobs
    assert second is None
    # The penalty turns the argmax to token 2, whose raw rank is 2.
    assert out.token_ids[0] == 2 and first is not None
    assert (first.token_id, first.logprob, first.rank) == (2, raw[2].item(), 2)
    assert list(first.top) == [1, 2, 0]  # most likely first
    assert list(first.top.values()) == [raw[1].item(), raw[2].item(), raw[0].item()]


def test_logprobs_zero_and_random_rows() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    rows = [
        make_row(SamplingParams(temperature=1.5, logprobs=n), seed=i)
        for i, n in enumerate((0, 20, 1, 5))
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp is not None and lp.token_id == token
        assert lp.logprob == raw[i, token].item()
        assert lp.rank == int((raw[i] > raw[i, token]).sum()) + 1
        assert list(lp.top) == raw[i].topk(rows[i].params.logprobs or 0).indices.tolist()


# --- the distribution ------------------------------------------------------------------------

NUM_DRAWS = 8000
CHI2_3DOF_P001 = 16.27


def draw_frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = [make_row(params, seed=s, position=s % 97) for s in range(NUM_DRAWS)]
    tokens = sample(logits.expand(NUM_DRAWS, -1), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    kept = probs > 0
    assert counts[~kept].sum() == 0  # never draws a masked token
    expected = probs[kept] * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum())


LOGITS_4 = torch.tensor([[1.0, 0.2, -0.5, 0.6]])


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), LOGITS_4.softmax(-1)),
        (SamplingParams(temperature=0.5), (LOGITS_4 / 0.5).softmax(-1)),
        (SamplingParams(temperature=2.0), (LOGITS_4 / 2.0).softmax(-1)),
        # probabilities 0.427, 0.192, 0.095, 0.286: top_p 0.7 keeps tokens 0 and 3, renormalised.
        (SamplingParams(top_p=0.7), LOGITS_4.softmax(-1) * torch.tensor([1.0, 0, 0, 1])),
        (SamplingParams(top_k=3, temperature=0.7), None),
    ],
)
def test_sampling_matches_the_processed_distribution(params, expected) -> None:
    probs = compute_probs(LOGITS_4, SamplingMetadata.build([make_row(params)], 4))[0].double()
    if expected is not None:
        expected = expected[0].double()
        assert torch.allclose(probs, expected / expected.sum(), atol=0.01)
    counts = draw_frequencies(LOGITS_4, params)
    assert chi_square(counts, probs) < CHI2_3DOF_P001


def test_temperature_sharpens_and_flattens() -> None:
    cold = draw_frequencies(LOGITS_4, SamplingParams(temperature=0.3))
    hot = draw_frequencies(LOGITS_4, SamplingParams(temperature=3.0))
    assert cold[0] > 0.6 * NUM_DRAWS and hot[0] < 0.35 * NUM_DRAWS
    assert hot[2] > 3 * cold[2]


def test_compute_probs_greedy_rows_are_one_hot() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    rows = [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(top_k=2))]
    probs = compute_probs(logits, SamplingMetadata.build(rows, 3))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    expected = torch.tensor([0.0, math.e, 1.0]) / (math.e + 1)
    assert torch.allclose(probs[1], expected)
