"""When each request reached each phase at a node, for its metrics and its trace spans.

Arrival, first token and finish are seen on the event loop (the servicer's stream). The moment
a request is first scheduled is only visible on the engine thread: the ScheduleWatcher, run by
EngineLoop's after_step hook, notices it by the request's status after each step and dates it
to that step's start. Its cost per step is one subtraction, plus one dict lookup per request
still waiting to be scheduled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.scheduler import RequestUpdate

AfterStep = Callable[[LLMEngine, list[RequestUpdate]], None]


@dataclass
class RequestTimes:
    """One request's phase boundaries at this node, in time.monotonic() seconds. Written once
    each (scheduled_s on the engine thread, the rest on the event loop); None until reached."""

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


class ScheduleWatcher:
    """Sets RequestTimes.scheduled_s of watched requests. Both methods run on the engine thread
    only (watch() from inside an EngineLoop.call), so _pending needs no lock."""

    def __init__(self) -> None:
        self._pending: dict[str, RequestTimes] = {}
        self._step_time_total_s = 0.0

    def watch(self, request_id: str, times: RequestTimes) -> None:
        """Date request_id's first scheduling into times (call right after add_request)."""
        self._pending[request_id] = times

    def after_step(self, engine: LLMEngine, updates: list[RequestUpdate]) -> None:
        # The step just run took the growth of the engine's cumulative step time; a request
        # that left WAITING in it was scheduled at its start.
        step_time_total_s = engine.stats.step_time_s
        step_start_s = time.monotonic() - (step_time_total_s - self._step_time_total_s)
        self._step_time_total_s = step_time_total_s
        if not self._pending:
            return
        requests = engine.scheduler.requests
        updated = {u.request_id for u in updates}
        for request_id in list(self._pending):
            request = requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING:
                continue
            times = self._pending.pop(request_id)
            # Gone without an update: aborted while it waited, never scheduled.
            if request is not None or request_id in updated:
                times.scheduled_s = step_start_s


def chain(*hooks: AfterStep | None) -> AfterStep:
    """One after_step hook running the given ones in order (None entries are skipped)."""
    present = [h for h in hooks if h is not None]

    def run(engine: LLMEngine, updates: list[RequestUpdate]) -> None:
        for hook in present:
            hook(engine, updates)

    return run
