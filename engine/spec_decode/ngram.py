"""N-gram (prompt lookup) proposals: guess that the text continues as it did the last time
its most recent words occurred. Free to compute and strong on repetitive text (code, quoted
context, greedy loops); the draft distribution is one-hot."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.engine.request import Request
from pdserve.engine.spec_decode.proposer import Proposal


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, trying n from max_n down to min_n; [] when nothing matches.

    The copy runs on past the end of the sequence into the tokens being proposed, so a match
    s tokens back continues with period s: [a b a b] proposes [a b a ...] for k = 3, not just
    the one token left before the end (a loop predicts itself)."""
    length = len(token_ids)
    if k < 1 or length < 2:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows start at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if matches.size:
            return _copy_forward(token_ids, int(matches[-1]) + n, k)
    return []


def _copy_forward(tokens: Sequence[int], source: int, k: int) -> list[int]:
    """k tokens copied from tokens[source:], reading on into what has been copied."""
    out: list[int] = []
    for i in range(source, source + k):
        out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
    return out


class NgramProposer:
    """Prompt lookup over each request's own prompt + output. Stateless."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        proposals = {}
        for request, k in requests:
            drafts = propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)
            if drafts:
                proposals[request.request_id] = Proposal(drafts)
        return proposals

    def rollback(self, request_id: str, num_tokens: int) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass
