"""Speculative decoding counters, named like vLLM's spec_decode metrics (exported as
pdserve:spec_decode_*)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counts over verifications. A verification is one request's drafts scored
    in one step; drafts the scheduler had no budget or room for are not counted."""

    num_speculative_tokens: int
    """k: the length of num_accepted_tokens_per_pos."""
    num_drafts: int = 0
    """Verifications (requests x steps that verified at least one draft)."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """[k]: how often the draft at position i of a run was accepted."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: num_accepted leading drafts of num_draft_tokens passed."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any verification)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the correction/bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
