"""Runs an LLMEngine in its own thread for an asyncio server (the node services).

The engine is single-threaded: only the engine thread touches it (it claims the engine, whose
state-changing methods then refuse other threads). Everything else talks to it through `call()`
(run a function on the engine thread, await its result) or `submit()` (fire and forget), and
receives what each step produced for a request on that request's stream: its updates and, on a
decode node, the remote prefill its admission asks for. Between steps the thread runs queued
calls; when there is nothing to compute it sleeps on its inbox, so an idle node burns no CPU.
Where nodes share cores (engine/core_turns.py), each step first waits for this node's turn.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.engine.core_turns import CoreTurns
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RemotePrefill, RequestUpdate, StepOutput
from pdserve.engine.request import RequestStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.5
"""How long the idle engine thread sleeps on its inbox before checking for stop."""
BLOCKED_WAIT_S = 0.002
"""Pause after a step that computed nothing (requests waiting for blocks or remote KV)."""
THROUGHPUT_WINDOW_S = 10.0


StreamItem = RequestUpdate | RemotePrefill
"""What a request's stream delivers: its new tokens, or (decode role, once, before any token)
the blocks reserved for a prefill node to fill."""


class RequestStream:
    """What the engine produced for one request, delivered on the event loop. A finished
    update ends it; an exception put here (e.g. the engine stopped) is raised by get()."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()

    def put(self, item: StreamItem | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self, timeout_s: float) -> StreamItem:
        """The next item; TimeoutError if none comes within timeout_s. (asyncio.timeout, not
        wait_for: no task per token.)"""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            async with asyncio.timeout(timeout_s):
                item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineLoop:
    """Owns the engine thread and delivers each step's output to the requests' streams."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        turns: CoreTurns | None = None,
    ) -> None:
        """turns: where the node shares its cores with other nodes, each step waits for its
        turn (engine/core_turns.py)."""
        self.engine = engine
        self.loop = loop
        self._turns = turns
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.error: BaseException | None = None

    # -- called on the event loop ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; raises what fn raises."""
        future: asyncio.Future[T] = self.loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, future, result)

        self.submit(run)
        return await future

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue fn to run on the engine thread (fire and forget)."""
        if self.error is not None:
            raise RuntimeError("the engine thread has stopped") from self.error
        self._inbox.put(fn)

    def open_stream(self, request_id: str) -> RequestStream:
        """Register a request's stream before adding the request, so no update is missed."""
        stream = RequestStream()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its blocks); an open stream gets a final FINISHED_ABORTED
        update and nothing after it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(RequestUpdate(request_id, [], [], True, RequestStatus.FINISHED_ABORTED))
        self.submit(lambda: self.engine.abort_request(request_id))

    def publish(self, updates: list[RequestUpdate]) -> None:
        """Deliver updates made on the engine thread (e.g. by finish_remote_prefill)."""
        if updates:
            self.loop.call_soon_threadsafe(self._deliver, StepOutput(updates))

    def _deliver(self, output: StepOutput) -> None:
        for rp in output.remote_prefills:
            stream = self._streams.get(rp.request_id)
            if stream is not None:
                stream.put(rp)
            else:  # nobody will fill the blocks (an abort on its way frees them)
                self.submit(functools.partial(self.engine.fail_remote_prefill, rp.request_id))
        for update in output.updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                stream.put(update)
                if update.finished:
                    del self._streams[update.request_id]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after its current step; every open stream gets an error."""
        self._stop.set()
        self._inbox.put(lambda: None)  # wake it
        self._thread.join(timeout_s)
        for stream in self._streams.values():
            stream.put(RuntimeError("the engine stopped"))
        self._streams.clear()

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def generation_tokens_per_s(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= THROUGHPUT_WINDOW_S]
        return sum(n for _, n in recent) / THROUGHPUT_WINDOW_S

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine.claim_thread()
            while not self._stop.is_set():
                self._run_inbox(wait_s=0.0 if self.engine.has_work() else IDLE_WAIT_S)
                if self._stop.is_set() or not self.engine.has_work():
                    continue
                output = self._step()
                if output:
                    self._note_tokens(output.updates)
                    self.loop.call_soon_threadsafe(self._deliver, output)
                if not output.updates:
                    self._run_inbox(wait_s=BLOCKED_WAIT_S)
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            logger.exception("engine thread failed")
            self.error = e
            self.loop.call_soon_threadsafe(self._fail_all, e)

    def _step(self) -> StepOutput:
        if self._turns is None:
            return self.engine.step()
        with self._turns.turn():
            return self.engine.step()

    def _run_inbox(self, wait_s: float) -> None:
        try:
            fn = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        fn()
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _note_tokens(self, updates: list[RequestUpdate]) -> None:
        now = time.monotonic()
        self._recent.append((now, sum(len(u.new_token_ids) for u in updates)))
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(RuntimeError(f"the engine failed: {error}"))
        self._streams.clear()


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
