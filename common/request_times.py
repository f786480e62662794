"""When each request reached each phase at a node, for its metrics and its trace spans.

All are seen on the event loop (the servicer's stream): arrival, first token and finish when
they happen; the moment a request was first scheduled, which only the engine thread sees, from
the engine's RequestUpdate (scheduled_s: the start of the step that first scheduled it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestTimes:
    """One request's phase boundaries at this node, in time.monotonic() seconds. Written once
    each, on the event loop; None until reached."""

    arrival_s: float
    """The RPC arrived."""
    scheduled_s: float | None = None
    """First admitted: blocks reserved (decode: also for a remote prefill) or first computed."""
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def queue_s(self) -> float | None:
        return _between(self.arrival_s, self.scheduled_s)

    @property
    def prefill_s(self) -> float | None:
        """From being scheduled to the first token (chunks, remote prefill, KV transfer)."""
        return _between(self.scheduled_s, self.first_token_s)

    @property
    def decode_s(self) -> float | None:
        return _between(self.first_token_s, self.finished_s)


def _between(start_s: float | None, end_s: float | None) -> float | None:
    if start_s is None or end_s is None:
        return None
    return max(end_s - start_s, 0.0)
