"""UCX transport through ucxx, imported lazily so the package works without it.

Tags. Each ucxx endpoint pair agrees on a control tag at connection time (ucxx's default
tag). Headers travel on it, in posting order. Each payload travels on its own tag derived
from (transfer_id, first_block) (ucxx further scopes it to the endpoint). The receiver takes
headers one by one and posts a tag receive for the matching payload, so concurrent send()
calls on one endpoint need no lock: UCX matches every payload to its header however the
messages interleave. Invariant: (transfer_id, first_block) is unique among the messages in
flight on one endpoint - true since a transfer's messages cover disjoint block ranges.

Progress mode. Default "thread" with Python futures (ucxx's notifier thread). Measured here
(2 cores): an idle receiver (listener, one connected endpoint, a header receive posted)
costs ~0% of a core (~3% with ucxx's 1 ms progress-thread epoll timeout, which
PROGRESS_EPOLL_TIMEOUT_MS replaces), while "polling", "thread-polling", "blocking", and
"thread" without Python futures (ucxx's own default) burn up to a whole core as soon as a
receive is pending (requests are then completed by yielding in a loop); it was also the
fastest mode here (see benchmarks/kv_transfer.py). Override with the standard
UCXPY_PROGRESS_MODE (and UCXPY_ENABLE_PYTHON_FUTURE) environment variables, read when ucxx is
first initialised.

Binding. ucxx's listener always binds 0.0.0.0 (its API has no bind address; ucxx builds the
listener's sockaddr with no host); UCX_NET_DEVICES=lo only keeps UCX's own tcp transport
sockets on 127.0.0.1, and UCX_TLS=tcp does not narrow the listener either. What holds the door
is the receiver (receiver.py): a message without the token of a transfer it expects is refused
before its payload is received or any buffer is taken, and its endpoint dropped. Firewall the
port (or use --kv-transport tcp, which binds --kv-host exactly) where even that is too much.

One event loop per process: ucxx is initialised once (first start() or send()), and its
progress and notifier threads deliver to the event loop running at that moment; using UCX
from another loop raises RuntimeError until shutdown_ucx(). The notifier thread is stopped
automatically at interpreter exit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.kvtransfer.receiver import BaseReceiver, Route, ScratchBuffer
from pdserve.kvtransfer.transport import (
    DEFAULT_SEND_TIMEOUT_S,
    KVSender,
    KVTransferError,
    advertised_host,
    payload_view,
    split_address,
)
from pdserve.kvtransfer.wire import MAX_HEADER_BYTES, TransferHeader, WireFormatError, header_size

logger = logging.getLogger(__name__)

DEFAULT_PROGRESS_MODE = "thread"
CONNECT_TIMEOUT_S = 5.0
"""Bound on the connection handshake (ucxx's default). It matters when nobody listens: about
half the time ucxx misses the endpoint error during the handshake and waits this long."""
_ABORT_PERIOD_NS = 10**9
"""Longest an endpoint abort waits for the progress thread (ucxx's default is 10 s)."""

_ucx_loop: asyncio.AbstractEventLoop | None = None
"""The event loop ucxx was initialised on; None before the first use or after a shutdown."""


def _ucxx() -> Any:
    """The ucxx module, initialised on the running event loop (once per process)."""
    # ucxx sets UCX_* variables some UCX builds do not know; do not warn about them
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    global _ucx_loop
    loop = asyncio.get_running_loop()
    if _ucx_loop is None:
        mode = os.environ.get("UCXPY_PROGRESS_MODE", DEFAULT_PROGRESS_MODE)
        python_future = None  # None: ucxx reads UCXPY_ENABLE_PYTHON_FUTURE
        if "UCXPY_ENABLE_PYTHON_FUTURE" not in os.environ:
            python_future = mode == "thread"
        _progress_thread_timeout(PROGRESS_EPOLL_TIMEOUT_MS)
        try:
            ucxx.init(progress_mode=mode, enable_python_future=python_future)
            logger.info("ucxx initialised: progress_mode=%s python_future=%s", mode, python_future)
        except RuntimeError:
            logger.warning("ucxx was already initialised elsewhere; its progress mode applies")
        # ucxx's notifier thread is not a daemon: unless stopped, the interpreter waits for
        # it forever at exit. This hook runs before Python joins non-daemon threads (it is
        # what concurrent.futures uses); atexit would run too late.
        threading._register_atexit(ucxx.stop_notifier_thread)  # type: ignore[attr-defined]
        _ucx_loop = loop
    elif _ucx_loop is not loop:
        raise RuntimeError(
            "ucxx is bound to another event loop; call kvtransfer.ucx.shutdown_ucx() first"
        )
    return ucxx


PROGRESS_EPOLL_TIMEOUT_MS = 100
"""How long ucxx's progress thread sleeps in epoll_wait with nothing to do ("thread" mode).
ucxx hard-codes 1 ms: an idle node's progress thread then woke ~1000 times a second (~2.4% of
a core here), each wake taking a core from a step's compute threads. UCX events and ucxx's
own submissions (delayed requests, endpoint aborts, stopping) wake the wait at once (the
worker's event fd, ucp_worker_signal), so the timeout only bounds housekeeping nothing
signals; transfer latency measured the same (benchmarks/kv_transfer.py)."""


def _progress_thread_timeout(timeout_ms: int) -> bool:
    """Have ucxx's "thread" progress mode start its progress thread with epoll_wait timing
    out after timeout_ms instead of ucxx's fixed 1 ms (its ThreadMode takes no argument for
    it, so the class ucxx.init() instantiates is swapped for one that passes it). A ucxx whose
    internals differ keeps its own (a warning); False then."""
    import weakref

    try:
        from ucxx._lib_async import application_context
        from ucxx._lib_async import continuous_ucx_progress as progress

        if getattr(application_context.ThreadMode, "epoll_timeout_ms", None) == timeout_ms:
            return True  # installed by an earlier initialisation in this process
        base, create_context = progress.ProgressTask, progress._create_context
        if application_context.ThreadMode is not progress.ThreadMode:
            raise AttributeError("ThreadMode is not ucxx's own")
    except (ImportError, AttributeError) as e:
        logger.warning("ucxx's progress thread keeps its 1 ms epoll timeout (%s)", e)
        return False

    class ThreadMode(base):  # type: ignore[misc, valid-type]
        epoll_timeout_ms = timeout_ms

        def __init__(self, worker: Any, event_loop: Any, polling_mode: bool = False) -> None:
            super().__init__(worker, event_loop)
            worker.set_progress_thread_start_callback(create_context)
            try:
                worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=timeout_ms)
            except TypeError:  # a ucxx without the argument
                worker.start_progress_thread(polling_mode=polling_mode)
            weakref.finalize(self, worker.stop_progress_thread)

    application_context.ThreadMode = ThreadMode
    return True


def shutdown_ucx() -> None:
    """Tear down ucxx's process-wide context so that a new event loop may use UCX (tests).
    Every UCX receiver and sender must be closed first."""
    global _ucx_loop
    if _ucx_loop is not None:
        import ucxx

        ucxx.reset()
        _ucx_loop = None


def payload_tag(header: TransferHeader) -> int:
    """The tag a message's payload travels on: stable across processes (no hash())."""
    key = f"{header.transfer_id}\x00{header.first_block}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def _abort(endpoint: Any) -> None:
    """Close an endpoint without flushing; never raises (the peer may be gone already)."""
    try:
        endpoint.abort(period=_ABORT_PERIOD_NS, max_attempts=1)
    except Exception as e:
        logger.debug("endpoint abort: %r", e)


def _release_frames(error: BaseException) -> None:
    """Clear the locals of the frames in error's traceback chain.

    After a failed connect, ucxx's C++ request keeps a future holding the exception, whose
    traceback holds create_endpoint()'s frame, which holds the dead endpoint and the ucxx
    context: a cycle through C++ that gc cannot collect (it leaks the endpoint and makes
    ucxx.reset() fail). Clearing the finished frames' locals breaks it.
    """
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips frames still executing
        pending += [exc.__context__, exc.__cause__]


class UcxReceiver(BaseReceiver):
    """A ucxx listener; one task per connected endpoint reads messages in header order."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self._host = host
        self._port = port
        self._listener: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def start(self) -> None:
        self._listener = _ucxx().create_listener(self._on_connect, port=self._port)
        self.address = f"ucx://{advertised_host(self._host)}:{self._listener.port}"

    async def close(self) -> None:
        self._closing = True
        self.expected.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # ucxx retires a finished connection handler one loop turn later; closing the
        # listener before that logs a spurious "client handler(s) still alive" warning.
        await asyncio.sleep(0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _on_connect(self, endpoint: Any) -> None:
        """Listener callback, run as a task on our loop for the endpoint's lifetime."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if not self._closing:
                await self._serve(endpoint)
        except asyncio.CancelledError:
            pass  # close() stops serving; ucxx's handler wrapper expects a normal return
        finally:
            self._tasks.discard(task)
            _abort(endpoint)
            # The server-side endpoint keeps the listener's port open until it is freed:
            # drop the references a task -> frame -> endpoint cycle would otherwise keep.
            task = endpoint = None

    async def _serve(self, endpoint: Any) -> None:
        header_buffer = np.empty(MAX_HEADER_BYTES, dtype=np.uint8)
        scratch = ScratchBuffer()
        while True:
            try:
                await endpoint.recv(header_buffer)
            except Exception as e:  # ucxx's error classes share no exported base
                logger.debug("%s: endpoint closed: %r", self.address, e)
                return
            try:
                header = TransferHeader.decode(header_buffer[: header_size(header_buffer)])
            except WireFormatError as e:
                # The payload's tag is unknown, so the stream cannot be resynchronised.
                logger.warning("%s: dropping endpoint: %s", self.address, e)
                return
            route = self.expected.route(header)
            if route not in (Route.ACCEPT, Route.DROP):
                # REFUSE (unauthenticated) or REJECT (a failed transfer, whose claimed size
                # is not bounded by the reservation): a tag receive needs a buffer of the
                # payload's size, so rather than take it, drop the endpoint; UCX discards the
                # rendezvous payload it never fetched.
                logger.debug("%s: dropping endpoint after a %s", self.address, route.name)
                return
            payload = scratch.get(header.payload_bytes)  # at most the reservation's bytes
            try:
                await endpoint.recv(payload, tag=payload_tag(header))
            except Exception as e:
                logger.warning("%s: endpoint lost mid-message: %r", self.address, e)
                return
            if route is Route.ACCEPT:
                self.expected.deliver(header, payload)


@dataclass
class _CachedEndpoint:
    """An endpoint to one receiver; lock serialises (re)connecting, not sending."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    endpoint: Any = None

    def reset(self, endpoint: Any) -> None:
        """Drop endpoint if it is still the cached one (a concurrent send may have
        replaced it already)."""
        if endpoint is not None and self.endpoint is endpoint:
            self.endpoint = None
            _abort(endpoint)


class UcxSender(KVSender):
    """Pushes messages over cached per-address ucxx endpoints."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _CachedEndpoint] = {}

    async def send(
        self,
        address: str,
        header: TransferHeader,
        payload: Any,
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        host, port = split_address(address, "ucx")
        view = payload_view(payload, header.payload_bytes)
        encoded = np.frombuffer(bytearray(header.encode()), dtype=np.uint8)
        cached = self._endpoints.setdefault(address, _CachedEndpoint())
        endpoint = None
        try:
            async with asyncio.timeout(timeout_s):
                endpoint = await self._connected(cached, host, port, timeout_s)
                await endpoint.send(encoded)
                await endpoint.send(view, tag=payload_tag(header))
        except asyncio.CancelledError:
            cached.reset(endpoint)  # aborting cancels the requests still holding our buffers
            raise
        except TimeoutError as e:
            cached.reset(endpoint)
            raise KVTransferError(f"send to {address} timed out after {timeout_s}s") from e
        except Exception as e:  # ucxx's error classes share no exported base
            cached.reset(endpoint)
            _release_frames(e)
            raise KVTransferError(f"send to {address} failed: {e!r}") from e

    async def close(self) -> None:
        for cached in self._endpoints.values():
            cached.reset(cached.endpoint)
        self._endpoints.clear()

    async def _connected(
        self, cached: _CachedEndpoint, host: str, port: int, timeout_s: float
    ) -> Any:
        async with cached.lock:
            if cached.endpoint is not None and cached.endpoint.closed:
                cached.reset(cached.endpoint)  # the peer went away since the last send
            if cached.endpoint is None:
                cached.endpoint = await _ucxx().create_endpoint(
                    host, port, connect_timeout=min(timeout_s, CONNECT_TIMEOUT_S)
                )
            return cached.endpoint
