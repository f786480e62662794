"""The engine's speculative decoding, called around each step.

    propose(running)      before schedule(): the policy picks requests and k, the proposer
                          drafts, drafts go to Request.spec_token_ids (the scheduler schedules
                          1 + k tokens for them) and their distributions to the model runner
    after_schedule(out)   proposer state of preempted and finished requests is freed
    after_step(...)       after update_from_output(): metrics, policy, proposer rollback to
                          the accepted prefix; finished requests are forgotten

Invariant: a request's spec_token_ids is non-empty only between propose() and the end of the
same step; drafts the scheduler did not verify are dropped, never carried over.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.outputs import RequestUpdate, SampledTokens, SchedulerOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.policy import SpeculationPolicy
from pdserve.engine.spec_decode.proposer import Proposal, Proposer


@dataclass
class _Pending:
    """A proposal awaiting verification this step."""

    request: Request
    num_tokens: int
    """The request's num_tokens when proposed (drafts start at this position)."""
    proposal: Proposal


def is_decoding(request: Request) -> bool:
    """Running with every known token computed but the last sampled one."""
    return (
        request.status is RequestStatus.RUNNING
        and request.num_computed_tokens == request.num_tokens - 1
    )


def build_proposer(
    config: SpeculativeConfig,
    dtype: str,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    device: torch.device | None = None,
) -> Proposer:
    """The proposer config.method names; a draft model gets config.draft_num_blocks KV blocks
    (default: as many as the target's num_blocks), on the target's device."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from pdserve.engine.spec_decode.draft_model import DraftModelProposer  # imports torch models

    assert config.model is not None  # validated by SpeculativeConfig
    return DraftModelProposer(
        config.model,
        dtype,
        vocab_size,
        max_model_len,
        config.draft_num_blocks or num_blocks,
        block_size,
        device,
    )


class Speculator:
    """Owns the proposer, the policy and the metrics of one engine."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = SpeculationPolicy(config, max_model_len)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self._pending: dict[str, _Pending] = {}

    def propose(self, running: Sequence[Request]) -> None:
        """Draft for this step's decoding requests (see the module docstring)."""
        planned = self.policy.plan([r for r in running if is_decoding(r)])
        if not planned:
            return
        requests = {r.request_id: r for r, _ in planned}
        start = time.perf_counter()
        proposals = self.proposer.propose(planned)
        num_drafts = sum(len(p.token_ids) for p in proposals.values())
        if num_drafts:
            self.policy.observe_proposer(num_drafts, time.perf_counter() - start)
        for request_id, proposal in proposals.items():
            request = requests[request_id]
            request.spec_token_ids = list(proposal.token_ids)
            self._pending[request_id] = _Pending(request, request.num_tokens, proposal)

    @property
    def draft_probs(self) -> Mapping[str, Tensor]:
        """Request id -> [k, V] distribution its drafts were drawn from (one-hot: absent)."""
        return {
            request_id: pending.proposal.probs
            for request_id, pending in self._pending.items()
            if pending.proposal.probs is not None
        }

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Free proposer state of requests that were preempted (they recompute) or finished."""
        for request_id in output.preempted_ids:
            self._pending.pop(request_id, None)
            self.proposer.free(request_id)
        for request_id in output.finished_ids:
            self._forget(request_id)

    def after_step(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, SampledTokens],
        updates: Sequence[RequestUpdate],
        execute_s: float = 0.0,
    ) -> None:
        """Fold verification results in; drop every draft not verified this step. execute_s:
        the step's compute time (a decode-only step's teaches the policy what tokens cost)."""
        if (
            execute_s > 0
            and output.chunks
            and all(len(c.token_ids) == 1 + c.num_spec_tokens for c in output.chunks)
        ):
            verifying = sum(1 for c in output.chunks if c.num_spec_tokens)
            self.policy.observe_step(len(output.chunks), verifying, execute_s)
        verified = {c.request_id: c.num_spec_tokens for c in output.chunks if c.num_spec_tokens}
        for request_id, pending in self._pending.items():
            pending.request.spec_token_ids = []
            num_drafts = verified.get(request_id, 0)
            result = sampled.get(request_id)
            num_accepted = len(result.token_ids) - 1 if num_drafts and result else 0
            if num_drafts:
                self.stats.record(num_drafts, num_accepted)
                self.policy.observe(request_id, num_drafts, num_accepted)
            self.proposer.rollback(request_id, pending.num_tokens + num_accepted)
        self._pending.clear()
        for update in updates:
            if update.finished:
                self._forget(update.request_id)

    def _forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.proposer.free(request_id)
        self.policy.forget(request_id)
