"""When not to speculate.

Speculation trades compute for latency: verifying k drafts makes a request's step compute
1 + k tokens instead of 1, which is nearly free while a decode step is bound by reading the
weights (small batches) and pure waste once the step is compute-bound (large batches) or
the drafts are mostly rejected. Two rules, thresholds in SpeculativeConfig:

1. Per step: with more than max_batch_for_speculation running decode requests, nobody
   speculates (the step is compute-bound; extra tokens cost what they would save).
2. Per request: an exponential moving average (weight acceptance_ema_alpha) of the fraction
   of its drafts accepted. When EMA * k falls below min_expected_accepted, the request stops
   proposing for backoff_steps steps, then probes again: its EMA restarts at the threshold
   (min_expected_accepted / k), so the probe's own acceptance rate decides whether it keeps
   speculating (rate >= threshold) or backs off again. A new request starts at EMA 1.

Also, k is capped per request at the tokens it may still produce: a step emits up to k + 1,
so k <= max_tokens - num_output_tokens - 1 and k <= max_model_len - num_tokens - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request


class SpeculationPolicy:
    """Decides each step who proposes and how many tokens; learns from verifications.
    Its clock is the number of plan() calls (one per engine step)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.threshold_rate = config.min_expected_accepted / config.num_speculative_tokens
        """Acceptance rate below which a request backs off."""
        self.step = 0
        self.ema: dict[str, float] = {}
        """Request id -> moving average of its acceptance rate (absent: never verified)."""
        self.resume_step: dict[str, int] = {}
        """Request id -> first step at which a backed-off request may propose again."""

    def plan(self, decodes: Sequence[Request]) -> list[tuple[Request, int]]:
        """This step's (request, k) for the running decode requests that should propose."""
        self.step += 1
        if len(decodes) > self.config.max_batch_for_speculation:
            return []
        planned = []
        for request in decodes:
            k = self.num_speculative_tokens(request)
            if k > 0:
                planned.append((request, k))
        return planned

    def num_speculative_tokens(self, request: Request) -> int:
        """k for this request now: 0 while backed off, capped by the tokens left."""
        if self.step < self.resume_step.get(request.request_id, 0):
            return 0
        params = request.sampling_params
        return max(
            min(
                self.config.num_speculative_tokens,
                params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            ),
            0,
        )

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Fold in one verification of num_drafts >= 1 tokens (this step's)."""
        alpha = self.config.acceptance_ema_alpha
        ema = self.ema.get(request_id, 1.0)
        ema = (1 - alpha) * ema + alpha * num_accepted / num_drafts
        if ema < self.threshold_rate:
            self.resume_step[request_id] = self.step + self.config.backoff_steps + 1
            ema = self.threshold_rate  # the probe after the backoff decides alone
        self.ema[request_id] = ema

    def forget(self, request_id: str) -> None:
        """The request left (finished or aborted)."""
        self.ema.pop(request_id, None)
        self.resume_step.pop(request_id, None)
