"""Lossless verification of speculative tokens: the standard rejection sampler.

A request at num_tokens = N proposes drafts d_0..d_{k-1}, each drawn from a distribution
q_i (one-hot for a deterministic proposer such as n-gram). The target scores all of them in
one forward, giving logits for positions N..N+k. p_i is exactly the distribution the plain
Sampler would draw position N+i from had d_<i been sampled: one SampleRow per position with
the output extended by the drafts before it and position N+i, so penalties, the min_tokens
eos mask, temperature, top-k/p, min-p, the seed and a structured-output grammar (its matcher
stepped through d_<i for row i, then back) all hold: a draft the grammar forbids has p_i = 0
and is rejected.

- Random rows: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
  rejection emit a token drawn from normalise(max(0, p_i - q_i)) and stop; after k accepted
  emit a bonus token drawn from p_k. Every emitted token is then distributed exactly as p
  (Leviathan et al. 2023; Chen et al. 2023).
- Greedy rows (p_i one-hot at the target's argmax): accept while d_i is the argmax, then
  emit the argmax (the correction at the first disagreement, or the bonus).

Randomness is a pure function of (seed, position, stream): acceptance uniforms come from
ACCEPT_STREAM, emitted tokens from SAMPLE_STREAM (a bonus token is the draw the plain sampler
would make), draft models draw from DRAFT_STREAM. Along a request's realised path each
(stream, position) is used at most once (positions only move forward), so the draws are
independent and a seeded run is reproducible. Logprobs of emitted tokens come from the
target's raw logits at their position, as the plain sampler's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType

import torch
from torch import Tensor

from pdserve.engine.outputs import SampledTokens
from pdserve.engine.request import TokenLogprobs
from pdserve.engine.sampler import (
    ACCEPT_STREAM,
    SAMPLE_STREAM,
    SampleRow,
    SamplingMetadata,
    compute_logprobs,
    compute_probs,
    random_sample,
    uniform_noise,
)


@dataclass
class DraftsToVerify:
    """One request's speculative tokens, to verify against the target's logits."""

    row: SampleRow
    """The request's row for its next token (position = num_tokens)."""
    token_ids: list[int]
    """The k >= 1 drafts, for positions row.position .. row.position + k - 1."""
    probs: Tensor | None
    """[k, V] distribution each draft was drawn from; None for one-hot (deterministic)."""


def _row_starts(items: Sequence[DraftsToVerify]) -> list[int]:
    """Index of each item's first row (it has k + 1)."""
    starts, offset = [], 0
    for item in items:
        starts.append(offset)
        offset += len(item.token_ids) + 1
    return starts


def expand_rows(item: DraftsToVerify) -> list[SampleRow]:
    """The k + 1 rows of a request: row i samples position + i after drafts d_<i."""
    row, drafts = item.row, item.token_ids
    return [row] + [
        replace(
            row,
            position=row.position + i,
            output_token_ids=[*row.output_token_ids, *drafts[:i]],
            grammar_drafts=tuple(drafts[:i]),
        )
        for i in range(1, len(drafts) + 1)
    ]


class RejectionSampler:
    """Verifies every speculating request of a step at once (one SamplingMetadata, one
    compute_probs over all their rows); no state but the runner's choice of kernels."""

    def __init__(self, cpu_ops: ModuleType | None = None) -> None:
        self.cpu_ops = cpu_ops
        """The compiled CPU kernels the runner chose (SamplingMetadata.cpu_ops)."""

    def __call__(self, logits: Tensor, items: Sequence[DraftsToVerify]) -> list[SampledTokens]:
        """logits: [sum(k_r + 1), V] raw target logits, each request's k_r + 1 rows in item
        order. Returns per item the accepted drafts followed by one correction/bonus token."""
        rows = [r for item in items for r in expand_rows(item)]
        meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device, self.cpu_ops)
        logits = logits.float()
        probs = compute_probs(logits, meta)
        seeds, positions, uniforms = self._row_noise(meta)
        starts = _row_starts(items)
        accepted = self._accept(probs, uniforms, items, starts)
        finals = [
            self._final_distribution(probs[start + a], item, a)
            for item, start, a in zip(items, starts, accepted, strict=True)
        ]
        final_rows = torch.tensor([s + a for s, a in zip(starts, accepted, strict=True)])
        emitted = random_sample(
            torch.stack(finals), seeds[final_rows], positions[final_rows], SAMPLE_STREAM
        ).tolist()
        token_lists = [
            item.token_ids[:a] + [tok]
            for item, a, tok in zip(items, accepted, emitted, strict=True)
        ]
        logprobs = self._logprobs(logits, meta, token_lists, starts)
        return [
            SampledTokens(tokens, lps) for tokens, lps in zip(token_lists, logprobs, strict=True)
        ]

    @staticmethod
    def _row_noise(meta: SamplingMetadata) -> tuple[Tensor, Tensor, Tensor]:
        """Per row: seed, position and acceptance uniform. Greedy rows get uniform 0, which
        turns the acceptance test below into "accept iff the draft is the argmax" (their p is
        one-hot), and seed 0 (their emitted token's distribution is one-hot)."""
        n = meta.num_rows
        seeds = torch.zeros(n, dtype=torch.int64)
        positions = torch.zeros(n, dtype=torch.int64)
        uniforms = torch.zeros(n)
        if not meta.all_greedy:
            seeds[meta.random_rows] = meta.seeds
            positions[meta.random_rows] = meta.positions
            noise = uniform_noise(meta.seeds, meta.positions, 1, ACCEPT_STREAM)
            uniforms[meta.random_rows] = noise[:, 0]
        return seeds, positions, uniforms

    @staticmethod
    def _accept(
        probs: Tensor, uniforms: Tensor, items: Sequence[DraftsToVerify], starts: list[int]
    ) -> list[int]:
        """Number of leading drafts accepted per item: d_i passes iff u_i * q_i(d_i) <
        p_i(d_i), i.e. u_i < p/q (a draft was drawn from q, so q_i(d_i) > 0)."""
        draft_rows = torch.tensor(
            [
                s + i
                for item, s in zip(items, starts, strict=True)
                for i in range(len(item.token_ids))
            ]
        )
        draft_ids = torch.tensor([t for item in items for t in item.token_ids])
        p_draft = probs[draft_rows, draft_ids]
        q_draft = torch.cat(
            [
                torch.ones(len(item.token_ids))
                if item.probs is None
                else item.probs.float()[torch.arange(len(item.token_ids)), item.token_ids]
                for item in items
            ]
        )
        passed = (uniforms[draft_rows] * q_draft < p_draft).tolist()
        accepted, offset = [], 0
        for item in items:
            k = len(item.token_ids)
            run = passed[offset : offset + k]
            accepted.append(run.index(False) if False in run else k)
            offset += k
        return accepted

    @staticmethod
    def _final_distribution(p: Tensor, item: DraftsToVerify, num_accepted: int) -> Tensor:
        """What the emitted token is drawn from: the bonus's p_k after all k accepted, else
        the residual normalise(max(0, p_a - q_a)) (unnormalised; random_sample normalises).
        Greedy rows stay one-hot: their p_a is zero at the rejected draft."""
        k = len(item.token_ids)
        if num_accepted == k or item.row.params.greedy:
            return p
        if item.probs is None:
            q = torch.zeros_like(p)
            q[item.token_ids[num_accepted]] = 1.0
        else:
            q = item.probs[num_accepted].float()
        residual = (p - q).clamp_(min=0.0)
        # p == q up to rounding leaves nothing (then the draft would have passed): fall back.
        return residual if float(residual.sum()) > 0.0 else p

    @staticmethod
    def _logprobs(
        logits: Tensor, meta: SamplingMetadata, token_lists: list[list[int]], starts: list[int]
    ) -> list[list[TokenLogprobs | None] | None]:
        if meta.logprob_rows is None:
            return [None] * len(token_lists)
        tokens = torch.zeros(meta.num_rows, dtype=torch.int64)
        for start, emitted in zip(starts, token_lists, strict=True):
            tokens[start : start + len(emitted)] = torch.tensor(emitted)
        per_row = compute_logprobs(logits, tokens, meta)
        return [
            per_row[start : start + len(emitted)] if per_row[start] is not None else None
            for start, emitted in zip(starts, token_lists, strict=True)
        ]
