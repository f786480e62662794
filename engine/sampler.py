"""Batched sampling where every row of the batch has its own SamplingParams.

A step's logits go through: logprobs of the raw logits (what the response reports) ->
the structured-output grammar's bitmask -> allowed_token_ids / bad words / logit_bias -> penalties -> min_tokens mask -> greedy argmax,
or temperature -> top-k -> top-p -> min-p -> a seeded draw. Every random number is a pure function of (seed, stream, position, token id),
so a seeded request samples the same tokens whatever else is in the batch, in whatever
order, and resumes identically from any position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from pdserve.engine.request import SamplingParams, TokenLogprobs
from pdserve.engine.structured_output import GrammarMatcher, allocate_bitmask, apply_bitmask

SAMPLE_STREAM = 0
"""uniform_noise stream of the sampler's own draws (and of the tokens a rejection sampler
emits); speculative decoding keys the two below, so that no two kinds of draw share noise."""
DRAFT_STREAM = 1
"""uniform_noise stream of a draft model's draws of its speculative tokens."""
ACCEPT_STREAM = 2
"""uniform_noise stream of the rejection sampler's acceptance tests."""


def argmax_rows(x: Tensor, ops: ModuleType | None = None) -> Tensor:
    """x.argmax(dim=-1) of a 2-D tensor (the same answer: the first index of the maximum, or of
    the first NaN); for contiguous float32 CPU rows through ops.argmax_rows when ops (the
    compiled CPU kernels a runner chose, SamplingMetadata.cpu_ops) is given."""
    if (
        ops is not None
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and not x.is_cuda
        and x.is_contiguous()
    ):
        return ops.argmax_rows(x)
    return x.argmax(dim=-1)


def _signed(x: int, bits: int) -> int:
    """x modulo 2**bits, as the two's-complement value torch's intN tensors hold."""
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >= 1 << (bits - 1) else x


_GOLDEN64 = _signed(0x9E3779B97F4A7C15, 64)
_SPLITMIX1 = _signed(0xBF58476D1CE4E5B9, 64)
_SPLITMIX2 = _signed(0x94D049BB133111EB, 64)
_GOLDEN32 = _signed(0x9E3779B9, 32)
_LOWBIAS1 = _signed(0x7FEB352D, 32)
_LOWBIAS2 = _signed(0x846CA68B, 32)


def _shr(x: Tensor, shift: int, bits: int) -> Tensor:
    """Logical right shift of a `bits`-wide signed tensor (torch's >> is arithmetic)."""
    return torch.bitwise_right_shift(x, shift).bitwise_and_((1 << (bits - shift)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 (multiplications wrap): a bijection mixing all bits."""
    x = (x ^ _shr(x, 30, 64)) * _SPLITMIX1
    x = (x ^ _shr(x, 27, 64)) * _SPLITMIX2
    return x ^ _shr(x, 31, 64)


def _lowbias32_(x: Tensor) -> Tensor:
    """Wellons' lowbias32 hash on int32, in place. 32-bit per token: 3x faster than 64 on CPU."""
    x ^= _shr(x, 16, 32)
    x *= _LOWBIAS1
    x ^= _shr(x, 15, 32)
    x *= _LOWBIAS2
    x ^= _shr(x, 16, 32)
    return x


def _to_int32(x: Tensor) -> Tensor:
    """The low 32 bits of an int64 tensor, as int32."""
    return (((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


def uniform_noise(seeds: Tensor, positions: Tensor, width: int, stream: int = 0) -> Tensor:
    """Uniforms in (0, 1): out[r, i] is a pure function of (seeds[r], positions[r], stream, i).

    seeds, positions: [N] int64. Returns [N, width] float32, multiples of 2**-23 offset by
    half a step, so never 0 or 1. A 64-bit key per row (splitmix64 of seed, stream, position)
    is split into two 32-bit halves that key a two-round 32-bit hash of the column index.
    """
    stream_offset = _signed((stream + 1) * 0x9E3779B97F4A7C15, 64)
    key = _splitmix64(_splitmix64(seeds + stream_offset) + positions * _GOLDEN64)
    key_low, key_high = _to_int32(key)[:, None], _to_int32(_shr(key, 32, 64))[:, None]
    columns = torch.arange(width, dtype=torch.int32, device=seeds.device) * _GOLDEN32
    bits = _lowbias32_(_lowbias32_(columns + key_low) ^ key_high)
    return _shr(bits, 9, 32).float().add_(0.5).mul_(2.0**-23)


def random_sample(
    probs: Tensor, seeds: Tensor, positions: Tensor, stream: int = 0, ops: ModuleType | None = None
) -> Tensor:
    """Draw one token per row of probs [N, V] (need not be normalised) -> [N] int64 (ops: as
    argmax_rows's).

    Exponential race: argmax(p_i / E_i) with E_i = -log(u_i) ~ Exp(1) picks i with
    probability p_i / sum(p), and only compares within a row, so rows never interact.
    """
    exponentials = uniform_noise(seeds, positions, probs.shape[-1], stream).log_().neg_()
    return argmax_rows(probs / exponentials, ops)


@dataclass
class SampleRow:
    """One row of logits to sample from."""

    params: SamplingParams
    seed: int
    """The request's effective seed."""
    position: int
    """Index in prompt + output of the token being sampled (= number of tokens so far)."""
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None
    """The request's structured-output matcher, at the end of its output (not of drafts)."""
    grammar_drafts: tuple[int, ...] = ()
    """Speculative tokens between the matcher's state and this row's position (verification
    rows: the grammar masks the position after them)."""


@dataclass(frozen=True)
class Penalties:
    """Penalty tensors for the rows that use any penalty (the others are left alone).

    Token matrices are right-padded with V, a spare column past the vocab, so penalties
    touch only the tokens a row has seen instead of all V."""

    rows: Tensor
    """[P] int64 rows of the batch these apply to."""
    repetition: Tensor
    """[P, 1] float32 HF repetition penalty."""
    presence: Tensor
    """[P, 1] float32 OpenAI presence penalty."""
    frequency: Tensor
    """[P, 1] float32 OpenAI frequency penalty."""
    seen_tokens: Tensor
    """[P, S] int64 prompt + output tokens, duplicates included."""
    output_tokens: Tensor
    """[P, O] int64 output tokens, duplicates included."""
    output_counts: Tensor
    """[P, O] float32: occurrences in the output of output_tokens[p, j]."""

    @staticmethod
    def build(rows: list[SampleRow], vocab_size: int, device: torch.device) -> Penalties | None:
        used = [i for i, row in enumerate(rows) if row.params.uses_penalties]
        if not used:
            return None
        chosen = [rows[i] for i in used]
        seen = [[*r.prompt_token_ids, *r.output_token_ids] for r in chosen]
        outputs = _token_matrix([r.output_token_ids for r in chosen], vocab_size, device)
        counts = torch.zeros(len(used), vocab_size + 1, device=device)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))

        def column(name: str) -> Tensor:
            values = [getattr(r.params, name) for r in chosen]
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        return Penalties(
            rows=_int64(used, device),
            repetition=column("repetition_penalty"),
            presence=column("presence_penalty"),
            frequency=column("frequency_penalty"),
            seen_tokens=_token_matrix(seen, vocab_size, device),
            output_tokens=outputs,
            output_counts=counts.gather(1, outputs),
        )


def _token_matrix(token_lists: list[Sequence[int]], pad: int, device: torch.device) -> Tensor:
    """Token lists right-padded with `pad` (a spare column past the vocab) -> [P, L] int64."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    padded = [[*tokens, *[pad] * (width - len(tokens))] for tokens in token_lists]
    return torch.tensor(padded, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's per-row sampling parameters as tensors; None / flags let common cases skip.

    Rows are the rows of the logits. Sampling-only tensors hold the R random (non-greedy)
    rows, in the order of random_rows.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_rows: Tensor
    """[R] int64 rows sampled at random (temperature > 0)."""
    temperature: Tensor | None
    """[R, 1] float32; None when every random row has temperature 1."""
    top_k: Tensor | None
    """[R] int64 in [1, V]; None when no random row uses top-k."""
    top_p: Tensor | None
    """[R] float32; None when no random row uses top-p."""
    min_p: Tensor | None
    """[R] float32; None when no random row uses min-p."""
    seeds: Tensor
    """[R] int64 effective seeds (reduced to int64)."""
    positions: Tensor
    """[R] int64 positions of the tokens being sampled."""
    penalties: Penalties | None
    stop_mask: tuple[Tensor, Tensor] | None
    """(rows [M], token ids [M]) set to -inf because their row is still below min_tokens."""
    allowed: tuple[Tensor, Tensor] | None
    """(rows [A], forbidden [A, V] bool): rows with allowed_token_ids and, for each, every
    token outside them; None when no row restricts its tokens."""
    bad_words_mask: tuple[Tensor, Tensor] | None
    """(rows [B], token ids [B]) set to -inf because they would complete a bad word."""
    logit_bias: tuple[Tensor, Tensor, Tensor] | None
    """(rows [K], token ids [K], biases [K] float32) added to the logits."""
    grammar_bitmask: tuple[Tensor, list[int]] | None
    """([N, ceil(V / 32)] int32 bitmask, rows that have a grammar): what each allows next."""
    num_logprobs: tuple[int | None, ...]
    """Per row: SamplingParams.logprobs."""
    logprob_rows: Tensor | None
    """[L] int64 rows that want logprobs; None when none do."""
    max_num_logprobs: int
    """The largest top-N any row asks for (0 when none)."""
    cpu_ops: ModuleType | None = None
    """The compiled CPU kernels the runner chose (argmax_rows), None: torch's."""

    @staticmethod
    def build(
        rows: list[SampleRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        cpu_ops: ModuleType | None = None,
    ) -> SamplingMetadata:
        device = torch.device(device)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        params = [rows[i].params for i in random]

        def column(values: list, dtype: torch.dtype, used: bool) -> Tensor | None:
            return torch.tensor(values, dtype=dtype, device=device) if used else None

        temperatures = [p.temperature for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        num_logprobs = tuple(row.params.logprobs for row in rows)
        logprob_rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        temperature = column(temperatures, torch.float32, any(t != 1.0 for t in temperatures))
        return SamplingMetadata(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=not random,
            all_random=len(random) == len(rows),
            random_rows=_int64(random, device),
            temperature=None if temperature is None else temperature[:, None],
            top_k=column(top_ks, torch.int64, any(k < vocab_size for k in top_ks)),
            top_p=column(
                [p.top_p for p in params], torch.float32, any(p.top_p < 1 for p in params)
            ),
            min_p=column(
                [p.min_p for p in params], torch.float32, any(p.min_p > 0 for p in params)
            ),
            seeds=_int64([_signed(rows[i].seed, 64) for i in random], device),
            positions=_int64([rows[i].position for i in random], device),
            penalties=Penalties.build(rows, vocab_size, device),
            stop_mask=_build_stop_mask(rows, vocab_size, device),
            allowed=_build_allowed(rows, vocab_size, device),
            bad_words_mask=_build_bad_words_mask(rows, vocab_size, device),
            logit_bias=_build_logit_bias(rows, vocab_size, device),
            grammar_bitmask=_build_grammar_bitmask(rows, vocab_size),
            num_logprobs=num_logprobs,
            logprob_rows=column(logprob_rows, torch.int64, bool(logprob_rows)),
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=0),
            cpu_ops=cpu_ops,
        )


def _int64(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _build_stop_mask(
    rows: list[SampleRow], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(row, token) pairs of eos and stop ids to forbid while a row is below min_tokens."""
    pairs = [
        (i, token)
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
        for token in {*row.eos_token_ids, *row.params.stop_token_ids}
        if token < vocab_size
    ]
    if not pairs:
        return None
    masked_rows, tokens = zip(*pairs, strict=True)
    return _int64(list(masked_rows), device), _int64(list(tokens), device)


def _build_allowed(
    rows: list[SampleRow], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """The rows with allowed_token_ids and a [A, V] mask of what each forbids (one scatter
    into a mask; the allowed lists are padded with V, a spare column dropped at the end)."""
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not restricted:
        return None
    lists = [rows[i].params.allowed_token_ids or () for i in restricted]
    allowed = _token_matrix(lists, vocab_size, device).clamp(max=vocab_size)
    forbidden = torch.ones(len(restricted), vocab_size + 1, dtype=torch.bool, device=device)
    forbidden.scatter_(1, allowed, False)
    return _int64(restricted, device), forbidden[:, :vocab_size]


def _build_bad_words_mask(
    rows: list[SampleRow], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(row, token) pairs completing a bad word: its last token, where the row's output ends
    with the word's other tokens (always, for a one-token word). The work is per bad word, not
    per vocabulary entry."""
    pairs = []
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        output = list(row.output_token_ids)
        for word in words:
            prefix_len = len(word) - 1
            if word[-1] < vocab_size and (
                prefix_len == 0
                or (prefix_len <= len(output) and output[-prefix_len:] == list(word[:-1]))
            ):
                pairs.append((i, word[-1]))
    if not pairs:
        return None
    masked_rows, tokens = zip(*pairs, strict=True)
    return _int64(list(masked_rows), device), _int64(list(tokens), device)


def _build_grammar_bitmask(
    rows: list[SampleRow], vocab_size: int
) -> tuple[Tensor, list[int]] | None:
    """Each constrained row's next-token bitmask, filled by its matcher (in C++; no loop over
    the vocabulary here). Rows without a grammar stay all-allowed and are not applied."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return None
    bitmask = allocate_bitmask(len(rows), vocab_size)
    for i in constrained:
        grammar = rows[i].grammar
        assert grammar is not None
        grammar.fill_bitmask(bitmask, i, rows[i].grammar_drafts)
    return bitmask, constrained


def _build_logit_bias(
    rows: list[SampleRow], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(row, token, bias) triples of every row's logit_bias."""
    triples = [
        (i, token, bias)
        for i, row in enumerate(rows)
        for token, bias in (row.params.logit_bias or {}).items()
        if token < vocab_size
    ]
    if not triples:
        return None
    biased_rows, tokens, biases = zip(*triples, strict=True)
    values = torch.tensor(biases, dtype=torch.float32, device=device)
    return _int64(list(biased_rows), device), _int64(list(tokens), device), values


def apply_token_constraints(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """allowed_token_ids, bad words (forbidden: -inf), then logit_bias (added). Returns a new
    tensor when any applies, else logits itself."""
    if meta.allowed is not None:
        restricted, forbidden = meta.allowed
        masked = logits[restricted].masked_fill(forbidden, float("-inf"))
        logits = logits.index_copy(0, restricted, masked)
    if meta.bad_words_mask is not None:
        logits = logits.index_put(meta.bad_words_mask, logits.new_tensor(float("-inf")))
    if meta.logit_bias is not None:
        biased_rows, tokens, biases = meta.logit_bias
        logits = logits.index_put((biased_rows, tokens), biases, accumulate=True)
    return logits


def apply_penalties(logits: Tensor, penalties: Penalties) -> Tensor:
    """Repetition (HF: over prompt + output, positive logits divided, negative multiplied),
    then presence and frequency (OpenAI: logit -= presence * (count > 0) + frequency * count,
    over output only). Returns a new [N, V] tensor.

    A token listed twice is written twice with the same value, so duplicates are harmless.
    """
    p = penalties
    rows = torch.nn.functional.pad(logits[p.rows], (0, 1))  # column V absorbs the padding
    seen = rows.gather(1, p.seen_tokens)
    rows.scatter_(1, p.seen_tokens, torch.where(seen > 0, seen / p.repetition, seen * p.repetition))
    offset = p.presence * (p.output_counts > 0) + p.frequency * p.output_counts
    rows.scatter_(1, p.output_tokens, rows.gather(1, p.output_tokens) - offset)
    return logits.index_copy(0, p.rows, rows[:, :-1])


_TOP_P_CANDIDATES = 256
"""Top-p first looks for the nucleus among this many most likely tokens (a partial sort)."""


def apply_top_k_top_p_min_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, min_p: Tensor | None
) -> Tensor:
    """Set to -inf what top-k [N] (1..V; V keeps all), then top-p [N] (keep the smallest set
    of most likely tokens whose probability reaches top_p, on the top-k-renormalised
    distribution), then min-p [N] (probability below min_p x the top one) drop.
    Ties at a boundary are all kept; the most likely token always survives.
    """
    if top_k is not None:
        logits = _apply_top_k(logits, top_k)
    if top_p is not None:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < _top_p_threshold(probs, top_p), float("-inf"))
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
        threshold = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def _apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    vocab_size = logits.shape[-1]
    limited = top_k < vocab_size
    # Partial-sort only as deep as the rows that limit k need (a full sort costs ~50x more).
    depth = int(torch.where(limited, top_k, 1).max())
    largest = logits.topk(depth, dim=-1).values
    threshold = largest.gather(1, (top_k.clamp(max=depth) - 1)[:, None])
    threshold = threshold.masked_fill(~limited[:, None], float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p_threshold(probs: Tensor, top_p: Tensor) -> Tensor:
    """[N, 1]: the probability of the least likely token in each row's nucleus (0 for p = 1).

    Searches the top _TOP_P_CANDIDATES tokens; rows whose nucleus is not within them (flat
    distributions) fall back to a full sort.
    """
    top_p = top_p[:, None]
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    threshold = _nucleus_floor(candidates, top_p)
    unresolved = (candidates.sum(dim=-1, keepdim=True) < top_p).squeeze(1)
    if candidates.shape[-1] < probs.shape[-1] and bool(unresolved.any()):
        everything = probs[unresolved].sort(dim=-1, descending=True).values
        threshold[unresolved] = _nucleus_floor(everything, top_p[unresolved])
    return threshold.masked_fill(top_p >= 1, 0.0)


def _nucleus_floor(descending: Tensor, top_p: Tensor) -> Tensor:
    """A token is in the nucleus while what is more likely than it sums to less than p."""
    mass_before = descending.cumsum(dim=-1) - descending
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    return descending.gather(1, num_kept - 1)


def process_logits(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The grammar's mask, token constraints (allowed ids, bad words, logit bias), penalties,
    then the min_tokens mask: the logits whose argmax greedy rows take. Never changes logits
    itself (the raw logits give the logprobs)."""
    if meta.grammar_bitmask is not None:
        bitmask, constrained = meta.grammar_bitmask
        logits = logits.clone()
        apply_bitmask(logits, bitmask.to(logits.device), constrained)
    logits = apply_token_constraints(logits, meta)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.stop_mask is not None:
        logits = logits.index_put(meta.stop_mask, logits.new_tensor(float("-inf")))
    return logits


def _random_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Processed logits [N, V] -> the distribution [R, V] each random row draws from."""
    if not meta.all_random:
        logits = logits[meta.random_rows]
    if meta.temperature is not None:
        logits = logits / meta.temperature
    logits = apply_top_k_top_p_min_p(logits, meta.top_k, meta.top_p, meta.min_p)
    return logits.softmax(dim=-1)


def compute_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Raw logits [N, V] -> the distribution [N, V] the Sampler draws each row from: greedy
    rows are one-hot at their argmax."""
    logits = process_logits(logits.float(), meta)
    if meta.all_random:
        return _random_probs(logits, meta)
    probs = torch.zeros_like(logits).scatter_(1, argmax_rows(logits, meta.cpu_ops)[:, None], 1.0)
    if not meta.all_greedy:
        probs[meta.random_rows] = _random_probs(logits, meta)
    return probs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[TokenLogprobs | None]
    """Per row; None where SamplingParams.logprobs is None."""


class Sampler:
    """Samples one token per row of a step's logits, each row with its own parameters."""

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        token_ids = self._sample(process_logits(logits, meta), meta)
        logprobs = compute_logprobs(logits, token_ids, meta)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    @staticmethod
    def _sample(logits: Tensor, meta: SamplingMetadata) -> Tensor:
        if meta.all_greedy:
            return argmax_rows(logits, meta.cpu_ops)
        probs = _random_probs(logits, meta)
        sampled = random_sample(probs, meta.seeds, meta.positions, ops=meta.cpu_ops)
        if meta.all_random:
            return sampled
        return argmax_rows(logits, meta.cpu_ops).index_copy_(0, meta.random_rows, sampled)


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Per row of the raw logits [N, V]: the logprob and rank of token_ids [N] and the top-N
    logprobs, for the rows whose SamplingParams ask for logprobs; None for the others."""
    if meta.logprob_rows is None:
        return [None] * meta.num_rows
    raw_logprobs = torch.log_softmax(logits.float()[meta.logprob_rows], dim=-1)
    return _gather_logprobs(raw_logprobs, token_ids, meta)


def _gather_logprobs(
    raw_logprobs: Tensor, token_ids: Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """raw_logprobs: [L, V] for meta.logprob_rows; token_ids: [N] sampled tokens."""
    assert meta.logprob_rows is not None
    rows = meta.logprob_rows.tolist()
    entries = token_logprobs(
        raw_logprobs,
        token_ids[meta.logprob_rows],
        [meta.num_logprobs[row] or 0 for row in rows],
    )
    out: list[TokenLogprobs | None] = [None] * meta.num_rows
    for row, entry in zip(rows, entries, strict=True):
        out[row] = entry
    return out


def token_logprobs(
    raw_logprobs: Tensor, token_ids: Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Per row of raw_logprobs [L, V] (log_softmax of the raw logits): the logprob and rank
    of token_ids [L] and the num_top[row] most likely tokens' logprobs."""
    chosen = token_ids[:, None]
    chosen_logprob = raw_logprobs.gather(1, chosen)
    ranks = (raw_logprobs > chosen_logprob).sum(dim=-1) + 1
    top = raw_logprobs.topk(max(num_top, default=0), dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    columns = zip(
        chosen[:, 0].tolist(), chosen_logprob[:, 0].tolist(), ranks.tolist(), num_top, strict=True
    )
    return [
        TokenLogprobs(
            token_id=token,
            logprob=logprob,
            rank=rank,
            top=dict(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
        for j, (token, logprob, rank, n) in enumerate(columns)
    ]
