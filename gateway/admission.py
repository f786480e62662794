"""Admission: a bound on requests in flight, and the drain on shutdown."""

from __future__ import annotations

import asyncio

from pdserve.gateway.errors import ApiError


class Ticket:
    """One admitted request's place; release() it exactly when the request is done (calling
    it again does nothing, so error paths may release defensively)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release()


class Admission:
    """Counts requests in flight (a request with n completions counts once). Beyond
    max_num_requests new ones are refused with 429 + Retry-After; while draining, with 503."""

    def __init__(self, max_num_requests: int, retry_after_s: int = 1) -> None:
        self.max_num_requests = max_num_requests
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> Ticket:
        """A ticket for one more request; raises ApiError (429 full, 503 draining)."""
        if self.draining:
            raise ApiError.unavailable("the gateway is shutting down", self.retry_after_s)
        if self.num_in_flight >= self.max_num_requests:
            raise ApiError.too_many_requests(
                f"too many requests in flight (limit {self.max_num_requests}); retry later",
                self.retry_after_s,
            )
        self.num_in_flight += 1
        self._idle.clear()
        return Ticket(self)

    def _release(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for those in flight; False if some outlived timeout_s."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
