"""Decode-side bookkeeping shared by every transport: ExpectedTransfers (the transfers a
receiver expects), BaseReceiver (a KVReceiver built on it) and ScratchBuffer.

A transport reads a message's header, asks ``route()`` what to do with the payload, reads it
(into a real buffer, or discards it) or drops the connection, then calls ``deliver()``.
Everything runs on the receiver's event loop, so no locks are needed.

Authentication. expect() issues a random token for each transfer (128 bits); the decode node
hands it to the prefill node with the address, and every message of the transfer carries it.
route() checks the token (constant-time compare) and the layout, block range and byte size
against the reservation before the transport reads a byte of payload or allocates for it: a
peer that does not hold the token of a transfer this receiver expects (or just finished) is
REFUSEd and its connection closed, whatever payload size it claims. The tokens of recently
finished or cancelled transfers are kept (bounded) so a legitimate sender's late messages are
read and discarded (DROP, at most the reservation's size) instead of costing it its connection.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdserve.kvtransfer.transport import KVReceiver, KVTransferError, OnBlocks, TransferStats
from pdserve.kvtransfer.wire import KVLayoutMismatch, LayoutSignature, TransferHeader

logger = logging.getLogger(__name__)


class Route(enum.Enum):
    """What a transport should do with the payload of a message (also the TCP ack status)."""

    ACCEPT = 0
    """Read it and deliver() it."""
    DROP = 1
    """A transfer that just finished or was cancelled (right token, at most its reservation's
    bytes): read and discard."""
    REJECT = 2
    """Known transfer (right token), wrong layout, block range or size: the transfer failed.
    Transports that can discard a stream in bounded pieces (TCP) read and discard the payload;
    others (UCX) drop the connection."""
    REFUSE = 3
    """No transfer this receiver knows, or the wrong token: close the connection without
    reading the payload (never acknowledged)."""


_RECENT_TRANSFERS = 4096
"""Finished or cancelled transfers whose late messages are still discarded politely."""


@dataclass
class _Transfer:
    layout: LayoutSignature
    num_blocks: int
    on_blocks: OnBlocks
    token: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    received_blocks: int = 0
    received_bytes: int = 0
    num_messages: int = 0
    first_arrival_s: float | None = None
    last_arrival_s: float = 0.0

    def fail(self, error: Exception) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class ExpectedTransfers:
    """transfer id -> progress of a transfer registered by expect() and not yet waited."""

    def __init__(self) -> None:
        self._transfers: dict[str, _Transfer] = {}
        self._recent: OrderedDict[str, tuple[str, int]] = OrderedDict()
        """transfer id -> (token, reserved bytes) of finished or cancelled transfers."""
        self._closed = False
        self.refused = 0
        """Messages refused (unknown transfer or wrong token) since the start."""

    def __len__(self) -> int:
        return len(self._transfers)

    def expect(
        self, transfer_id: str, layout: LayoutSignature, num_blocks: int, on_blocks: OnBlocks
    ) -> str:
        if self._closed:
            raise KVTransferError("receiver is closed")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        token = secrets.token_hex(16)
        self._transfers[transfer_id] = _Transfer(layout, num_blocks, on_blocks, token)
        return token

    def route(self, header: TransferHeader) -> Route:
        """Decide the fate of a message whose header just arrived, before any of its payload is
        read; a REJECT fails its transfer."""
        transfer = self._transfers.get(header.transfer_id)
        if transfer is None or transfer.done.is_set():
            token, reserved = self._recent.get(header.transfer_id, ("", 0))
            if transfer is not None:
                token, reserved = transfer.token, transfer.num_blocks * transfer.layout.block_bytes
            if token and _same(token, header.token) and header.payload_bytes <= reserved:
                logger.debug("dropping a late message of transfer %s", header.transfer_id)
                return Route.DROP
            return self._refuse(header, "no such transfer")
        if not _same(transfer.token, header.token):
            return self._refuse(header, "wrong token")
        if transfer.first_arrival_s is None:
            transfer.first_arrival_s = time.perf_counter()
        try:
            transfer.layout.check(header.layout)
        except KVLayoutMismatch as e:
            logger.warning("transfer %s: %s", header.transfer_id, e)
            transfer.fail(e)
            return Route.REJECT
        end = header.first_block + header.num_blocks
        if end > transfer.num_blocks:
            transfer.fail(
                KVTransferError(
                    f"transfer {header.transfer_id}: blocks [{header.first_block}, {end}) "
                    f"outside the expected [0, {transfer.num_blocks})"
                )
            )
            return Route.REJECT
        return Route.ACCEPT

    def _refuse(self, header: TransferHeader, why: str) -> Route:
        self.refused += 1
        logger.warning(
            "refusing a KV message claiming %d bytes for transfer %.64r: %s",
            header.payload_bytes,
            header.transfer_id,
            why,
        )
        return Route.REFUSE

    def _remember(self, transfer_id: str, transfer: _Transfer) -> None:
        self._recent[transfer_id] = (
            transfer.token,
            transfer.num_blocks * transfer.layout.block_bytes,
        )
        self._recent.move_to_end(transfer_id)
        while len(self._recent) > _RECENT_TRANSFERS:
            self._recent.popitem(last=False)

    def deliver(self, header: TransferHeader, payload: np.ndarray) -> None:
        """Hand an ACCEPTed message's payload to on_blocks and count it."""
        transfer = self._transfers.get(header.transfer_id)
        if transfer is None or transfer.done.is_set():
            return  # cancelled while its payload was in flight
        try:
            transfer.on_blocks(header, payload)
        except Exception as e:
            logger.exception("on_blocks of transfer %s raised", header.transfer_id)
            transfer.fail(KVTransferError(f"on_blocks raised {e!r}"))
            return
        transfer.received_blocks += header.num_blocks
        transfer.received_bytes += header.payload_bytes
        transfer.num_messages += 1
        transfer.last_arrival_s = time.perf_counter()
        if transfer.received_blocks >= transfer.num_blocks:
            transfer.done.set()

    async def wait(self, transfer_id: str, timeout_s: float) -> TransferStats:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            raise KeyError(f"transfer {transfer_id!r} is not expected")
        try:
            async with asyncio.timeout(timeout_s):
                await transfer.done.wait()
        except TimeoutError as e:
            raise TimeoutError(
                f"transfer {transfer_id}: {transfer.received_blocks}/{transfer.num_blocks} "
                f"blocks after {timeout_s}s"
            ) from e
        finally:
            # Only pop our own entry: after a cancel() the id may have been expected anew.
            if self._transfers.get(transfer_id) is transfer:
                del self._transfers[transfer_id]
                self._remember(transfer_id, transfer)
        if transfer.error is not None:
            raise transfer.error
        start_s = transfer.first_arrival_s or transfer.last_arrival_s
        return TransferStats(
            transfer.received_bytes, transfer.last_arrival_s - start_s, transfer.num_messages
        )

    def cancel(self, transfer_id: str) -> None:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            self._remember(transfer_id, transfer)
            transfer.fail(KVTransferError(f"transfer {transfer_id} cancelled"))

    def close(self) -> None:
        """Fail every pending transfer; later expect() calls raise."""
        self._closed = True
        for transfer_id in list(self._transfers):
            transfer = self._transfers.pop(transfer_id)
            transfer.fail(KVTransferError(f"receiver closed during transfer {transfer_id}"))


def _same(expected: str, got: str) -> bool:
    return hmac.compare_digest(expected.encode(), got.encode())


class ScratchBuffer:
    """A reusable uint8 buffer that grows to the largest size asked for."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def get(self, num_bytes: int) -> np.ndarray:
        if self._buffer.nbytes < num_bytes:
            self._buffer = np.empty(num_bytes, dtype=np.uint8)
        return self._buffer[:num_bytes]


class BaseReceiver(KVReceiver):
    """A KVReceiver whose expect / wait / cancel go through an ExpectedTransfers table;
    transports subclass it and only move bytes."""

    def __init__(self) -> None:
        self.address = ""
        self.expected = ExpectedTransfers()

    def expect(
        self, transfer_id: str, layout: LayoutSignature, num_blocks: int, on_blocks: OnBlocks
    ) -> str:
        return self.expected.expect(transfer_id, layout, num_blocks, on_blocks)

    async def wait(self, transfer_id: str, timeout_s: float) -> TransferStats:
        return await self.expected.wait(transfer_id, timeout_s)

    def cancel(self, transfer_id: str) -> None:
        self.expected.cancel(transfer_id)
