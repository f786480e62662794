"""Getting a reserved request's prompt KV from a prefill node.

For each candidate in order: register the expected transfer with the KV receiver, call the
candidate's Prefill RPC (it pushes the blocks, then answers with the first token), wait until
every block has arrived, then hand the first token to the engine. A failed candidate (RPC
error, deadline, transfer failure, layout mismatch) is skipped; when none delivers, the
request prefills locally. All of this runs on the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from pdserve.common import tracing
from pdserve.common.node import GRPC_OPTIONS
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.protocol import (
    layout_to_proto,
    logprob_from_proto,
    lora_to_proto,
    sampling_params_to_proto,
)
from pdserve.common.tls import TLSFiles, aio_channel
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_block_io import KVBlockIO
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.outputs import RemotePrefill, SampledTokens
from pdserve.engine.utils import cdiv
from pdserve.kvtransfer.transport import KVReceiver, KVTransferError
from pdserve.kvtransfer.wire import KVLayoutMismatch, LayoutSignature, TransferHeader
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass
class InFlightRequest:
    """A decode request as the node sees it while it is in flight."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object  # engine.request.SamplingParams
    seed: int
    cache_salt: str
    candidates: list[str]
    prefilled_by: str = "local"
    kv_bytes: int = 0
    transfer_id: str | None = None
    """The transfer currently expected, if any (cancelled before the blocks are freed)."""
    task: asyncio.Task | None = None
    trace_context: Context | None = None
    """Parent of the request's remote prefill spans (None when tracing is off)."""
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with (None: the base model)."""


_PROGRESS_CHECK_S = 0.5
"""How often a running Prefill call looks at its progress."""
_PROGRESS_GRACE_S = 1.0
"""Without a KV message for this long, the prefill node is probed for liveness."""
_PROBE_TIMEOUT_S = 1.0
"""A prefill node that does not answer a load probe within this long is hung."""


@dataclass
class _Arrivals:
    """What the decode side sees of one transfer's messages, for its kv.receive span."""

    trace_context: dict[str, str] = field(default_factory=dict)
    """The W3C context the prefill node put in the first message's header."""
    first_s: float | None = None
    last_s: float | None = None

    def note(self, header: TransferHeader) -> None:
        self.last_s = time.monotonic()
        if self.first_s is None:
            self.first_s = self.last_s
            self.trace_context = header.trace_context


class PrefillClient:
    """Runs remote prefills for the decode node."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        receiver: KVReceiver,
        layout: LayoutSignature,
        prefill_timeout_s: float,
        transfer_timeout_s: float,
        metrics: NodeMetrics,
        tls: TLSFiles | None = None,
    ) -> None:
        self.engine_loop = engine_loop
        self.tls = tls
        """Mutual TLS to the prefill nodes (common/tls.py); None: plaintext."""
        self.receiver = receiver
        self.layout = layout
        self.prefill_timeout_s = prefill_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._kv_block_io: KVBlockIO | None = None
        self._probes: dict[str, tuple[float, asyncio.Future]] = {}
        """address -> (when, GetLoad call) of the latest liveness probe (_alive)."""

    def _stub(self, address: str) -> node_pb2_grpc.PrefillNodeStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = aio_channel(address, self.tls, GRPC_OPTIONS)
            self._channels[address] = channel
        return node_pb2_grpc.PrefillNodeStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def cancel_transfer(self, tracked: InFlightRequest) -> None:
        """Stop scattering for this request now (before its blocks can be freed)."""
        if tracked.transfer_id is not None:
            self.receiver.cancel(tracked.transfer_id)
            tracked.transfer_id = None

    async def run(self, rp: RemotePrefill, tracked: InFlightRequest) -> None:
        """Fill rp's blocks from the first candidate that delivers, else prefill locally."""
        engine = self.engine_loop.engine
        for address in tracked.candidates:
            span = tracing.start_span(
                "decode.remote_prefill",
                tracked.trace_context,
                SpanKind.CLIENT,
                {"pdserve.request_id": tracked.request_id, "pdserve.prefill_node": address},
            )
            try:
                response, num_bytes = await self._try(address, rp, tracked, span)
            except asyncio.CancelledError as e:
                self._abort_remote(address, tracked)
                tracing.end_span(span, e)
                raise
            except (grpc.aio.AioRpcError, KVTransferError, TimeoutError, ValueError) as e:
                self.cancel_transfer(tracked)
                tracing.end_span(span, e)
                logger.warning("%s: prefill on %s failed: %s", tracked.request_id, address, e)
                continue
            span.set_attributes(
                {"pdserve.kv_bytes": num_bytes, "pdserve.cached_tokens": response.num_cached_tokens}
            )
            tracing.end_span(span)
            tracked.prefilled_by = f"remote:{address}"
            tracked.kv_bytes = num_bytes
            first = SampledTokens(
                [response.first_token_id],
                [logprob_from_proto(response.first_logprob)]
                if response.HasField("first_logprob")
                else None,
            )
            cached = response.num_cached_tokens
            self.engine_loop.submit(partial(self._join, tracked.request_id, first, cached))
            return
        logger.info("%s: no prefill node delivered; prefilling locally", tracked.request_id)
        self.engine_loop.submit(lambda: engine.fail_remote_prefill(tracked.request_id))

    def _join(self, request_id: str, first: SampledTokens, num_cached_tokens: int) -> None:
        """On the engine thread: the request joins the running batch with its first token."""
        update = self.engine_loop.engine.finish_remote_prefill(request_id, first, num_cached_tokens)
        if update is not None:
            self.engine_loop.publish([update])

    async def _try(
        self, address: str, rp: RemotePrefill, tracked: InFlightRequest, span: Span
    ) -> tuple[node_pb2.PrefillResponse, int]:
        block_size = self.layout.block_size
        skip = rp.num_local_cached_tokens // block_size
        num_blocks = cdiv(len(tracked.prompt_token_ids), block_size) - skip
        # Not derived from the client's request id (any length): a fixed-size random id.
        transfer_id = uuid.uuid4().hex
        engine_loop = self.engine_loop
        kv_blocks = await self._kv_blocks()
        block_ids = rp.block_ids
        arrivals = _Arrivals()

        def on_blocks(header: TransferHeader, payload) -> None:
            # wire block j is the request's block skip + j (the receiver checked the range)
            start = skip + header.first_block
            target = block_ids[start : start + header.num_blocks]
            # the transport reuses its buffer once this returns (a GPU cache: into pinned memory)
            data = kv_blocks.stage(payload)
            # Written on the engine thread, between steps: queued before the request's join
            # (or its abort), so every block is in place before the request computes or frees.
            engine_loop.submit(lambda: engine_loop.engine.kv_blocks.scatter(target, data))
            arrivals.note(header)

        lora = tracked.lora
        layout = self.layout.with_adapter(lora.lora_name if lora is not None else None)
        token = self.receiver.expect(transfer_id, layout, num_blocks, on_blocks)
        tracked.transfer_id = transfer_id
        request = node_pb2.PrefillRequest(
            request_id=tracked.request_id,
            prompt_token_ids=tracked.prompt_token_ids,
            sampling_params=sampling_params_to_proto(tracked.sampling_params),
            seed=tracked.seed,
            cache_salt=tracked.cache_salt,
            kv_target=node_pb2.KVTarget(
                address=self.receiver.address,
                transfer_id=transfer_id,
                skip_blocks=skip,
                layout=layout_to_proto(layout),
                token=token,
            ),
        )
        if lora is not None:
            request.lora.CopyFrom(lora_to_proto(lora))
        metadata = tracing.grpc_metadata(tracing.context_of(span))
        call = self._stub(address).Prefill(
            request, timeout=self.prefill_timeout_s, metadata=metadata
        )
        response = await self._watched(call, address, arrivals)
        try:
            stats = await self.receiver.wait(transfer_id, timeout_s=self.transfer_timeout_s)
        except (KVTransferError, TimeoutError, KVLayoutMismatch):
            self.metrics.transfer_failed()
            raise
        tracked.transfer_id = None
        self.metrics.observe_transfer(stats)
        self._record_receive(arrivals, span, transfer_id, stats.bytes, stats.num_messages)
        return response, stats.bytes

    async def _kv_blocks(self) -> KVBlockIO:
        """The engine's KVBlockIO, asked of the engine thread once; only its stage() is used
        here (any thread)."""
        if self._kv_block_io is None:
            self._kv_block_io = await self.engine_loop.call(lambda engine: engine.kv_blocks)
        return self._kv_block_io

    async def _watched(self, call: Any, address: str, arrivals: _Arrivals) -> Any:
        """The Prefill call's response. While it runs, a node that sent no KV for
        _PROGRESS_GRACE_S is asked for its load (at most one probe per node at a time): a
        queue is fine, silence is not; a node that does not answer within _PROBE_TIMEOUT_S
        is hung (SIGSTOP, a stuck process): TimeoutError, so the caller tries the next
        candidate or prefills locally, seconds into the hang rather than at its end."""
        task = asyncio.ensure_future(call)
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_PROGRESS_CHECK_S)
                if done:
                    return task.result()
                last = max(started, arrivals.last_s or 0.0)
                if time.monotonic() - last >= _PROGRESS_GRACE_S and not await self._alive(address):
                    raise TimeoutError(f"prefill node {address} stopped answering")
        finally:
            if not task.done():
                call.cancel()
                task.cancel()

    async def _alive(self, address: str) -> bool:
        """Whether the node answers GetLoad within _PROBE_TIMEOUT_S (one probe shared by every
        request waiting on the node; its answer kept for _PROGRESS_CHECK_S)."""
        probe = self._probes.get(address)
        now = time.monotonic()
        if probe is None or (probe[1].done() and now - probe[0] > _PROGRESS_CHECK_S):
            stub = self._stub(address)
            future = asyncio.ensure_future(
                stub.GetLoad(node_pb2.GetLoadRequest(), timeout=_PROBE_TIMEOUT_S)
            )
            probe = self._probes[address] = (now, future)
        try:
            await asyncio.shield(probe[1])
        except grpc.aio.AioRpcError:
            return False
        return True

    @staticmethod
    def _record_receive(
        arrivals: _Arrivals, span: Span, transfer_id: str, num_bytes: int, num_messages: int
    ) -> None:
        """kv.receive, under the prefill node's span that the KV header names (else under the
        Prefill call): first message to last."""
        if not span.is_recording() or arrivals.first_s is None or arrivals.last_s is None:
            return
        parent = tracing.extract(arrivals.trace_context) or tracing.context_of(span)
        attributes = {
            "pdserve.transfer_id": transfer_id,
            "pdserve.kv_bytes": num_bytes,
            "pdserve.kv_messages": num_messages,
        }
        tracing.record_span("kv.receive", parent, arrivals.first_s, arrivals.last_s, attributes)

    def _abort_remote(self, address: str, tracked: InFlightRequest) -> None:
        """The request went away mid-prefill: stop receiving and tell the prefill node."""
        self.cancel_transfer(tracked)
        abort = node_pb2.AbortRequest(request_id=tracked.request_id)
        call = self._stub(address).Abort(abort, timeout=2.0)
        asyncio.ensure_future(_ignore_errors(call))


async def _ignore_errors(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        logger.debug("abort on prefill node failed: %s", e)
