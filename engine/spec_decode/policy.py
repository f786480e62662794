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
   threshold) or backs off again, for twice as long after each failed probe in a row. A new
   request starts at EMA 1, or backed off when the recent acceptance rate over all requests
   is below the threshold. Where the threshold reaches 1 nobody proposes.

The threshold is what speculation costs, measured. StepCost fits the engine's decode steps'
time as fixed + per_request x requests + per_verification x requests verifying. In a step of
n decodes (time T(n)), a request's verification of k drafts adds per_verification seconds
(plus its proposer's time, per draft p) and returns rate x k tokens on average; the step's
tokens per second rise iff rate x k / n > (per_verification + k x p) / T(n), i.e.
rate > n x (per_verification / k + p) / T(n): the marginal cost of a draft over the average
cost of a token in a plain step, times a COST_MARGIN for noise. A batch of one on a weights-bound step
speculates on almost anything; a batch of four on a CPU, where a verification's extra tokens
cost nearly their share, only on drafts that are mostly accepted. Until steps with and
without verifications have been seen, and never below it, min_expected_accepted / k is the
threshold (0 turns the
back-off off: every request within max_batch_for_speculation speculates every step).

Also, k is capped per request at the tokens it may still produce: a step emits up to k + 1,
so k <= max_tokens - num_output_tokens - 1 and k <= max_model_len - num_tokens - 1.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request

COST_MARGIN = 1.3
"""Speculate only where the measured gain beats the measured cost by this factor (the fit and
the acceptance EMA are noisy, and a verification has fixed costs the per-token line averages
out; the target is never to be more than ~5% slower)."""
RECENT_ALPHA = 0.1
"""Weight of the latest verification in the acceptance rate over all requests."""
MAX_BACKOFF_DOUBLINGS = 4
"""A request that keeps failing its probes waits at most backoff_steps x 2^4 steps."""


class StepFit(NamedTuple):
    """seconds = fixed + per_request x requests + per_verification x requests verifying."""

    fixed: float
    per_request: float
    per_verification: float
    """A verification of (about) k drafts: its tokens, the multi-token path its chunk takes,
    the rejection sampler."""


class StepCost:
    """Least squares over the engine's last `window` decode-only steps: what a step costs
    against its requests and the requests verifying drafts in it. Refit every REFIT_STEPS
    steps; no fit (None) until some steps verify and some do not, so the policy speculates on
    its floor until it has seen what a verification costs."""

    REFIT_STEPS = 8

    def __init__(self, window: int = 256) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._new = 0
        self.fit: StepFit | None = None

    def observe(self, requests: int, verifying: int, seconds: float) -> None:
        self._steps.append((requests, verifying, seconds))
        self._new += 1
        if self._new >= self.REFIT_STEPS:
            self._new = 0
            self._refit()

    def _refit(self) -> None:
        steps = np.array(self._steps, dtype=np.float64)
        requests, verifying, seconds = steps[:, 0], steps[:, 1], steps[:, 2]
        if len(steps) < 8 or verifying.std() < 0.1:
            self.fit = None
            return
        varied = requests.std() >= 0.5  # else per_request folds into fixed (one batch size)
        columns = [np.ones_like(requests), *([requests] if varied else []), verifying]
        coef = np.maximum(np.linalg.lstsq(np.stack(columns, 1), seconds, rcond=None)[0], 0.0)
        fixed, per_verification = float(coef[0]), float(coef[-1])
        self.fit = StepFit(fixed, float(coef[1]) if varied else 0.0, per_verification)

    def seconds(self, requests: int) -> float | None:
        """A plain step's predicted seconds (no verification)."""
        if self.fit is None:
            return None
        return self.fit.fixed + self.fit.per_request * requests


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
        self.recent_rate: float | None = None
        """EMA (weight RECENT_ALPHA) of every verification's acceptance rate: a new request's
        prior."""
        self.failures: dict[str, int] = {}
        """Request id -> back-offs in a row (probes that failed since it last kept up)."""

    def plan(self, decodes: Sequence[Request]) -> list[tuple[Request, int]]:
        """This step's (request, k) for the running decode requests that should propose."""
        self.step += 1
        if len(decodes) > self.config.max_batch_for_speculation:
            return []
        self.threshold_rate = self._threshold_rate(len(decodes))
        if self.threshold_rate >= 1:  # not even drafts that are all accepted would pay
            return []
        planned = []
        for request in decodes:
            self._start(request.request_id)
            k = self.num_speculative_tokens(request)
            if k > 0:
                planned.append((request, k))
        return planned

    def _start(self, request_id: str) -> None:
        """A request seen for the first time starts speculating at once where recent requests'
        drafts were accepted often enough, and backed off (a probe after backoff_steps) where
        they were not: a new request's first verifications would cost the most otherwise."""
        if request_id in self.ema:
            return
        prior = self.recent_rate
        if prior is not None and prior < self.threshold_rate:
            self.ema[request_id] = self.threshold_rate
            self.resume_step[request_id] = self.step + self.config.backoff_steps
        else:
            self.ema[request_id] = 1.0

    def _threshold_rate(self, n: int) -> float:
        """The acceptance rate at which n decodes' speculation pays (module docstring)."""
        plain = self.cost.seconds(n)
        if not plain or self.cost.fit is None or self.min_rate == 0:  # 0: back-off off
            return self.min_rate
        fit, k = self.cost.fit, self.config.num_speculative_tokens
        per_draft = fit.per_verification / k + self.propose_s_per_draft
        return max(self.min_rate, COST_MARGIN * n * per_draft / plain)

    def observe_step(self, requests: int, verifying: int, seconds: float) -> None:
        """A decode-only step of `requests` requests, `verifying` of them verifying drafts,
        took seconds."""
        self.cost.observe(requests, verifying, seconds)

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
        rate = num_accepted / num_drafts
        recent = self.recent_rate
        self.recent_rate = rate if recent is None else recent + RECENT_ALPHA * (rate - recent)
        ema = self.ema.get(request_id, 1.0)
        ema = (1 - alpha) * ema + alpha * rate
        if ema < self.threshold_rate:
            # each failed probe in a row doubles the wait (up to MAX_BACKOFF_DOUBLINGS times):
            # a probe costs a verification, which text that never repeats keeps paying for
            failures = self.failures.get(request_id, 0)
            self.failures[request_id] = failures + 1
            wait = self.config.backoff_steps << min(failures, MAX_BACKOFF_DOUBLINGS)
            self.resume_step[request_id] = self.step + wait + 1
            ema = self.threshold_rate  # the probe after the backoff decides alone
        else:
            self.failures.pop(request_id, None)
        self.ema[request_id] = ema

    def forget(self, request_id: str) -> None:
        """The request left (finished or aborted)."""
        self.ema.pop(request_id, None)
        self.resume_step.pop(request_id, None)
        self.failures.pop(request_id, None)
