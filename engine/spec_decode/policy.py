"""When not to speculate.

Speculation trades compute for latency: verifying k drafts makes a request's step compute
1 + k tokens instead of 1, which is nearly free while a decode step is bound by reading the
weights (small batches) and pure waste once the step is compute-bound (large batches) or
the drafts are mostly rejected. Two rules, thresholds in SpeculativeConfig:

1. Per step: with more than max_batch_for_speculation running decode requests, nobody
   speculates (the step is compute-bound; extra tokens cost what they would save).
2. Per request: an exponential moving average (weight acceptance_ema_alpha) of the fraction
   of its drafts accepted. When it falls below the step's threshold rate, the request stops
   proposing for backoff_steps steps, then probes again: its EMA restarts at the threshold,
   so the probe's own acceptance rate decides whether it keeps speculating (rate >=
   threshold) or backs off again. A new request starts at EMA 1.

The threshold is what speculation costs, measured. StepCost fits the engine's decode steps'
time as fixed + per_token x tokens. In a step of n decodes (time T(n)), a request's k drafts
add k x per_token seconds (plus its proposer's time, per draft p) and return rate x k tokens
on average; the step's tokens per second rise iff rate x k / n > k x (per_token + p) / T(n),
i.e. rate > n x (per_token + p) / T(n): the marginal cost of a token over the average cost of
one in a plain step, times a COST_MARGIN for noise. A batch of one on a weights-bound step
speculates on almost anything; a batch of four on a CPU, where a verification's extra tokens
cost nearly their share, only on drafts that are mostly accepted. Until steps of two sizes
have been seen, and never below it, min_expected_accepted / k is the threshold (0 turns the
back-off off: every request within max_batch_for_speculation speculates every step).

Also, k is capped per request at the tokens it may still produce: a step emits up to k + 1,
so k <= max_tokens - num_output_tokens - 1 and k <= max_model_len - num_tokens - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request

COST_MARGIN = 1.15
"""Speculate only where the measured gain beats the measured cost by this factor (the fit and
the acceptance EMA are noisy; the target is never to be more than ~5% slower)."""


class StepCost:
    """The least-squares line seconds = fixed + per_token x tokens over the engine's recent
    decode-only steps, each step's weight decaying by `decay` per newer one."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weight, tokens, seconds, tokens^2, tokens x seconds
        self.fit: tuple[float, float] | None = None
        """(fixed, per_token) seconds of the last fit with a spread of step sizes."""

    def observe(self, tokens: int, seconds: float) -> None:
        w, st, ss, stt, sts = (x * self.decay for x in self._sums)
        self._sums = [w + 1, st + tokens, ss + seconds, stt + tokens**2, sts + tokens * seconds]
        w, st, ss, stt, sts = self._sums
        var = stt / w - (st / w) ** 2
        if w >= 4 and var >= 0.25:  # steps of more than one size among the recent ones
            per_token = max((sts / w - st / w * ss / w) / var, 0.0)
            self.fit = (max(ss / w - per_token * st / w, 0.0), per_token)

    def seconds(self, tokens: int) -> float | None:
        if self.fit is None:
            return None
        fixed, per_token = self.fit
        return fixed + per_token * tokens


class SpeculationPolicy:
    """Decides each step who proposes and how many tokens; learns from verifications.
    Its clock is the number of plan() calls (one per engine step)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.min_rate = config.min_expected_accepted / config.num_speculative_tokens
        """The floor of the threshold (and the threshold until StepCost has a fit)."""
        self.threshold_rate = self.min_rate
        """Acceptance rate below which a request backs off (this step's)."""
        self.cost = StepCost()
        """The engine's decode step time against its tokens (engine/spec_decode/speculator.py
        feeds it)."""
        self.propose_s_per_draft = 0.0
        """EMA of the proposer's seconds per draft token it made."""
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
        self.threshold_rate = self._threshold_rate(len(decodes))
        planned = []
        for request in decodes:
            k = self.num_speculative_tokens(request)
            if k > 0:
                planned.append((request, k))
        return planned

    def _threshold_rate(self, n: int) -> float:
        """The acceptance rate at which n decodes' speculation pays (module docstring)."""
        plain = self.cost.seconds(n)
        if not plain or self.cost.fit is None or self.min_rate == 0:  # 0: back-off off
            return self.min_rate
        per_token = self.cost.fit[1] + self.propose_s_per_draft
        return max(self.min_rate, COST_MARGIN * n * per_token / plain)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step (verifications included) computed tokens in seconds."""
        self.cost.observe(tokens, seconds)

    def observe_proposer(self, num_drafts: int, seconds: float) -> None:
        """The proposer made num_drafts >= 1 draft tokens in seconds."""
        alpha = self.config.acceptance_ema_alpha
        per_draft = seconds / num_drafts
        self.propose_s_per_draft += alpha * (per_draft - self.propose_s_per_draft)

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
