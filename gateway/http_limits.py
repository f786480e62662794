"""Read deadlines for the REST server: uvicorn closes idle kept-alive connections, but waits
forever for a client that connects and sends its headers (or its body) a byte at a time.
This protocol (uvicorn's h11 one, with a timer) gives every request header_timeout_s from its
first byte (or the connection's opening) until its headers and then its body are read; a
connection past the deadline is closed. Responses, however long they stream, are not timed.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a read deadline of header_timeout_s per request (for
    uvicorn.Config(http=...))."""

    class DeadlineH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None
        _timed_cycle: object = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # a new request begins on a kept-alive connection
            super().data_received(data)
            cycle = self.cycle
            if (
                self._read_timer is not None
                and cycle is not None
                and cycle is not self._timed_cycle
                and not cycle.more_body
            ):
                self._disarm()  # headers and body of the new request are in

        def _arm(self) -> None:
            self._timed_cycle = self.cycle
            self._read_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _expired(self) -> None:
            self._read_timer = None
            logger.info(
                "closing a connection from %s: request not read within %.0f s",
                self.client,
                header_timeout_s,
            )
            self.transport.close()

    return DeadlineH11Protocol
