"""In-process transport for unit tests: a registry name -> receiver, on one event loop.

send() copies the payload and round-trips the header through its wire encoding, so tests
exercise the same bytes and the same receiver bookkeeping as the network transports.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from pdserve.kvtransfer.receiver import BaseReceiver, Route
from pdserve.kvtransfer.transport import (
    DEFAULT_SEND_TIMEOUT_S,
    KVSender,
    KVTransferError,
    payload_view,
)
from pdserve.kvtransfer.wire import TransferHeader

_SCHEME = "inproc://"
_receivers: dict[str, InprocReceiver] = {}
_names = itertools.count()


class InprocReceiver(BaseReceiver):
    """Registered under "inproc://recv-N" while started."""

    async def start(self) -> None:
        self.address = f"{_SCHEME}recv-{next(_names)}"
        _receivers[self.address] = self

    def receive(self, header: TransferHeader, payload: Any) -> None:
        route = self.expected.route(header)
        if route is Route.REFUSE:
            raise KVTransferError(f"{self.address} refused a message of {header.transfer_id}")
        if route is Route.ACCEPT:
            self.expected.deliver(header, payload)

    async def close(self) -> None:
        _receivers.pop(self.address, None)
        self.expected.close()


class InprocSender(KVSender):
    """Delivers straight into a registered receiver of the same process and event loop."""

    async def send(
        self,
        address: str,
        header: TransferHeader,
        payload: Any,
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        data = payload_view(payload, header.payload_bytes).copy()
        wire_header = TransferHeader.decode(header.encode())
        await asyncio.sleep(0)  # a real send yields to the loop; so does this one
        receiver = _receivers.get(address)
        if receiver is None:
            raise KVTransferError(f"no inproc receiver at {address!r}")
        receiver.receive(wire_header, data)

    async def close(self) -> None:
        return None
