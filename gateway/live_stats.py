"""Sliding windows of recent latencies and token counts, for the status page (/dashboard).

Prometheus histograms answer "what were the percentiles over any window" for a Prometheus
server; the status page must answer it alone, so the gateway also keeps the raw samples of the
last minute (bounded) and per-second token counts. Everything here runs on the event loop.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

WINDOW_S = 60.0
"""Percentiles on the status page cover this many seconds."""
RATE_WINDOW_S = 10
"""Throughput on the status page is averaged over this many seconds."""
MAX_SAMPLES = 20_000
"""Samples kept per window at most (the oldest are dropped first): bounds memory and the cost
of a percentile query under heavy load."""
QUANTILES = (0.5, 0.9, 0.99)


class LatencyWindow:
    """Latency samples of the last WINDOW_S seconds."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=max_samples
        )

    def add(self, now_s: float, value_s: float) -> None:
        self._samples.append((now_s, value_s))

    def summary(self, now_s: float) -> dict[str, float | int | None]:
        """{"count", "p50", "p90", "p99"} over the window (percentiles None when empty)."""
        while self._samples and now_s - self._samples[0][0] > self._window_s:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        out: dict[str, float | int | None] = {"count": len(values)}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = _nearest_rank(values, q)
        return out


def _nearest_rank(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[max(math.ceil(q * len(sorted_values)) - 1, 0)]


class RateWindow:
    """Event counts per whole second, kept for RATE_WINDOW_S seconds."""

    def __init__(self, window_s: int = RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._counts: collections.deque[list[int]] = collections.deque()  # [second, count]

    def add(self, now_s: float, count: int = 1) -> None:
        second = int(now_s)
        if self._counts and self._counts[-1][0] == second:
            self._counts[-1][1] += count
        else:
            self._counts.append([second, count])
            self._prune(second)

    def per_second(self, now_s: float) -> float:
        """Mean events per second over the last window_s whole seconds (the current partial
        second excluded, so an idle stream reads 0 rather than a fraction)."""
        second = int(now_s)
        self._prune(second)
        total = sum(c for s, c in self._counts if s < second)
        return total / self._window_s

    def _prune(self, second: int) -> None:
        while self._counts and self._counts[0][0] < second - self._window_s:
            self._counts.popleft()


@dataclass
class SequenceStats:
    """The windows of one scope: the whole gateway, or one decode node."""

    ttft: LatencyWindow = field(default_factory=LatencyWindow)
    itl: LatencyWindow = field(default_factory=LatencyWindow)
    e2e: LatencyWindow = field(default_factory=LatencyWindow)
    tokens: RateWindow = field(default_factory=RateWindow)
    finished: RateWindow = field(default_factory=RateWindow)

    def summary(self, now_s: float) -> dict[str, object]:
        return {
            "ttft_s": self.ttft.summary(now_s),
            "itl_s": self.itl.summary(now_s),
            "e2e_s": self.e2e.summary(now_s),
            "generation_tokens_per_s": self.tokens.per_second(now_s),
            "requests_per_s": self.finished.per_second(now_s),
        }


class LiveStats:
    """Windows for the gateway as a whole and per decode node (by address)."""

    def __init__(self) -> None:
        self.total = SequenceStats()
        self.by_node: dict[str, SequenceStats] = {}

    def node(self, address: str) -> SequenceStats:
        stats = self.by_node.get(address)
        if stats is None:
            stats = self.by_node[address] = SequenceStats()
        return stats
