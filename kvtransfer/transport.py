"""The transport interfaces: a decode-side KVReceiver, a prefill-side KVSender, and factories.

Push model: the decode node reserves blocks, calls ``receiver.expect()`` for a new transfer
id (which issues the transfer's token), asks a prefill node (over gRPC) to push to
``receiver.address`` with that id and token in every header, then awaits
``receiver.wait()``. The prefill node calls ``sender.send()`` once per message as blocks
become final. Each arriving message is handed to the transfer's ``on_blocks`` callback,
which scatters it into the reserved blocks.

Transports: "ucx" (ucxx, tag send/recv), "tcp" (asyncio sockets), "inproc" (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.kvtransfer.wire import LayoutSignature, TransferHeader

DEFAULT_SEND_TIMEOUT_S = 30.0

OnBlocks = Callable[[TransferHeader, np.ndarray], None]
"""Called with a message's header and its payload as a uint8 array of header.payload_bytes.
The array is only valid during the call: the callee copies what it keeps."""


class KVTransferError(RuntimeError):
    """A transfer failed: connection refused or lost, timed out, cancelled, receiver closed."""


@dataclass
class TransferStats:
    """What one completed transfer took on the receiving side."""

    bytes: int
    """Payload bytes delivered to on_blocks."""
    seconds: float
    """From the first message's arrival to the end of the last one's payload."""
    num_messages: int


class KVReceiver(ABC):
    """Decode side: accepts pushed messages and routes each to the transfer it belongs to.

    All methods run on one asyncio event loop. A message is authenticated by its transfer's
    token before any of its payload is read: without the token of an expected (or just
    finished) transfer its connection is closed, nothing allocated. Late data of a cancelled
    or finished transfer (right token) is read and discarded without breaking the connection.
    """

    address: str
    """Where senders push to, set by start(): "ucx://HOST:PORT", "tcp://HOST:PORT",
    "inproc://NAME"."""

    @abstractmethod
    async def start(self) -> None:
        """Start listening; sets self.address."""

    @abstractmethod
    def expect(
        self, transfer_id: str, layout: LayoutSignature, num_blocks: int, on_blocks: OnBlocks
    ) -> str:
        """Register a transfer of num_blocks blocks (request block indices [0, num_blocks))
        before the sender is asked to push it; its messages then go to on_blocks. Returns the
        transfer's token (a secret: only its sender may see it), which every message's header
        must carry. A transfer_id already registered raises ValueError."""

    @abstractmethod
    async def wait(self, transfer_id: str, timeout_s: float) -> TransferStats:
        """Wait until num_blocks blocks (summed over messages) arrived and return the stats.

        Raises KVLayoutMismatch if a message's layout differs from the expected one (its
        payload is discarded, never passed to on_blocks), TimeoutError after timeout_s,
        KVTransferError if the transfer was cancelled, a message fell outside
        [0, num_blocks), on_blocks raised, or the receiver closed; KeyError if transfer_id
        is not expected. Always unregisters the transfer: data arriving for it later is
        dropped.
        """

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Unregister a transfer (a no-op if unknown); data arriving for it later is read
        and discarded. A pending wait() on it raises KVTransferError."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening, drop connections, fail every pending wait() with KVTransferError.
        Never hangs."""


class KVSender(ABC):
    """Prefill side: pushes messages to receivers. Connections are cached per address and
    re-created after a failure. All methods run on one asyncio event loop; several send()
    calls may run concurrently, also to the same address."""

    @abstractmethod
    async def send(
        self,
        address: str,
        header: TransferHeader,
        payload: Any,
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        """Push one message and return once it is delivered (TCP: acknowledged by the
        receiver; UCX: the send request completed, which for payloads above UCX's
        rendezvous threshold means the receiver has the data).

        payload: any C-contiguous buffer of header.payload_bytes bytes (numpy array,
        memoryview, bytes, a torch CPU tensor's ``.view(torch.uint8).numpy()``); it must stay
        unchanged until send() returns. Raises KVTransferError on connection failure or
        after timeout_s, ValueError if the payload size does not match the header.
        """

    @abstractmethod
    async def close(self) -> None:
        """Close every cached connection. Never hangs."""


def payload_view(payload: Any, expected_bytes: int) -> np.ndarray:
    """A flat uint8 view (no copy) of a C-contiguous buffer; ValueError if the size is off."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise ValueError("payload must be C-contiguous")
        view = payload.reshape(-1).view(np.uint8)
    else:
        buffer = memoryview(payload)
        if not buffer.c_contiguous:
            raise ValueError("payload must be C-contiguous")
        view = np.frombuffer(buffer.cast("B"), dtype=np.uint8)
    if view.nbytes != expected_bytes:
        raise ValueError(f"payload has {view.nbytes} bytes, header says {expected_bytes}")
    return view


def split_address(address: str, scheme: str) -> tuple[str, int]:
    """ "tcp://127.0.0.1:5000" -> ("127.0.0.1", 5000); ValueError on another scheme."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    host, sep, port = address[len(prefix) :].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address needs HOST:PORT: {address!r}")
    return host, int(port)


@functools.cache
def _network_transports() -> tuple[str, ...]:
    return ("ucx", "tcp") if _ucxx_imports() else ("tcp",)


def available_transports() -> list[str]:
    """Network transports usable in this environment: "tcp" always, "ucx" if ucxx imports."""
    return list(_network_transports())


def _ucxx_imports() -> bool:
    if importlib.util.find_spec("ucxx") is None:
        return False
    # ucxx sets UCX_* variables some UCX builds do not know; do not warn about them at start-up
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx  # noqa: F401
    except Exception:  # a broken native library raises OSError/ImportError/RuntimeError
        return False
    return True


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_host(host: str) -> str:
    """The host a receiver bound to host gives senders: host itself, or for a wildcard this
    machine's address (its hostname resolved: a container's or a pod's own IP)."""
    if host not in WILDCARD_HOSTS:
        return host
    return socket.gethostbyname(socket.gethostname())


def make_receiver(kind: str, host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
    """A receiver of the given kind ("ucx" | "tcp" | "inproc"), not yet started.

    host is the address advertised to senders (and, for tcp, the one bound); a wildcard
    ("0.0.0.0") binds every interface and advertises advertised_host(). port 0 picks a free
    one. The UCX listener binds every interface whatever host says (ucxx offers no bind
    address). inproc ignores both.
    """
    if kind == "ucx":
        from pdserve.kvtransfer.ucx import UcxReceiver

        return UcxReceiver(host, port)
    if kind == "tcp":
        from pdserve.kvtransfer.tcp import TcpReceiver

        return TcpReceiver(host, port)
    if kind == "inproc":
        from pdserve.kvtransfer.inproc import InprocReceiver

        return InprocReceiver()
    raise ValueError(f"unknown transport {kind!r}; choose ucx, tcp or inproc")


def make_sender(kind: str) -> KVSender:
    """A sender of the given kind ("ucx" | "tcp" | "inproc")."""
    if kind == "ucx":
        from pdserve.kvtransfer.ucx import UcxSender

        return UcxSender()
    if kind == "tcp":
        from pdserve.kvtransfer.tcp import TcpSender

        return TcpSender()
    if kind == "inproc":
        from pdserve.kvtransfer.inproc import InprocSender

        return InprocSender()
    raise ValueError(f"unknown transport {kind!r}; choose ucx, tcp or inproc")
