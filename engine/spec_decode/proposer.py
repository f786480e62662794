"""The interface every speculative proposer implements, and what it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from pdserve.engine.request import Request


@dataclass
class Proposal:
    """Speculative tokens for one request's next positions."""

    token_ids: list[int]
    """k >= 1 drafts for positions num_tokens .. num_tokens + k - 1."""
    probs: Tensor | None = None
    """[k, V] float32 distribution each draft was drawn from; None means one-hot (the
    proposer is deterministic: n-gram)."""


class Proposer(Protocol):
    """Proposes drafts for requests that are decoding (every known token but the last one
    computed by the target). Must never block: a proposer that cannot serve a request (no
    match, no room in its cache) leaves it out."""

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        """Up to k drafts for each (request, k); request id -> proposal, for those that got
        any. May update per-request state (a draft model's KV)."""
        ...

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """After verification: the request's first num_tokens tokens are the ones the proposer
        saw or proposed (its prompt and output before the step plus the accepted drafts);
        forget any state past them."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop all its state (idempotent)."""
        ...
