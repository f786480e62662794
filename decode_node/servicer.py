"""The DecodeNode gRPC service: a thin adapter from the wire to the engine loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator

import grpc

from pdserve.common import tracing
from pdserve.common.node_service import NodeError, NodeService
from pdserve.common.protocol import (
    finish_reason_to_proto,
    logprob_to_proto,
    lora_from_proto,
    sampling_params_from_proto,
)
from pdserve.decode_node.prefill_client import InFlightRequest, PrefillClient
from pdserve.decode_node.telemetry import DecodeRequestTelemetry, DecodeTelemetry
from pdserve.engine.engine_loop import EngineLoop, RequestStream
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RemotePrefill, RequestUpdate
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(NodeService, node_pb2_grpc.DecodeNodeServicer):
    """Admits requests, streams their tokens; remote prefills go through the PrefillClient."""

    role = "decode"

    def __init__(
        self,
        engine_loop: EngineLoop,
        prefiller: PrefillClient | None,
        node_id: str,
        model: str,
        token_timeout_s: float,
        telemetry: DecodeTelemetry,
        metrics_address: str = "",
        model_version: str = "",
    ) -> None:
        super().__init__(engine_loop, node_id, model, metrics_address, model_version)
        self.prefiller = prefiller
        self.token_timeout_s = token_timeout_s
        self.telemetry = telemetry
        self.tracked: dict[str, InFlightRequest] = {}
        self._seeds = random.Random()

    # -- RPCs --------------------------------------------------------------------------------------

    async def Generate(
        self, request: node_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        rid = request.request_id
        self.check_accepting()
        if not rid or rid in self.tracked:
            raise NodeError.invalid(f"bad or duplicate id {rid!r}")
        params = sampling_params_from_proto(request.sampling_params)
        lora = lora_from_proto(request.lora) if request.HasField("lora") else None
        await self.compile_grammar(params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        prompt = list(request.prompt_token_ids)
        candidates = list(request.prefill_candidates) if self.prefiller else []
        observed = self.telemetry.begin(rid, len(prompt), context.invocation_metadata())
        tracked = InFlightRequest(
            rid, prompt, params, seed, request.cache_salt, candidates, lora=lora
        )
        tracked.trace_context = observed.context
        stream = self.loop.open_stream(rid)
        self.tracked[rid] = tracked

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                rid,
                prompt,
                params,
                priority=request.priority,
                cache_salt=request.cache_salt or None,
                seed=seed,
                wants_remote_prefill=bool(candidates),
                lora_request=lora,
            )

        try:
            await self.loop.call(add)
        except ValueError as e:  # a bad request: INVALID_ARGUMENT
            self.tracked.pop(rid, None)
            self.loop.close_stream(rid)
            tracing.end_span(observed.span, e)
            raise
        # aclosing: a caller that leaves ends _stream (and aborts the request) at once.
        async with contextlib.aclosing(
            self._stream(rid, stream, tracked, observed, context)
        ) as out:
            async for chunk in out:
                yield chunk

    async def _stream(
        self,
        rid: str,
        stream: RequestStream,
        tracked: InFlightRequest,
        observed: DecodeRequestTelemetry,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        """The request's chunks until it finishes; aborts it if the caller leaves first."""
        finished_reason: str | None = None
        error: BaseException | None = None
        try:
            first = True
            while finished_reason is None:
                update = await stream.get(self.token_timeout_s)
                if isinstance(update, RemotePrefill):
                    self._start_remote_prefill(update, tracked)
                    continue
                observed.on_update(update)
                if update.finished:
                    finished_reason = update.status.finish_reason
                yield self._chunk(update, tracked, first)
                first = False
        except TimeoutError as e:
            error = e
            raise NodeError.deadline("no token within the deadline") from e
        except RuntimeError as e:  # the engine stopped or failed
            error = e
            raise NodeError.unavailable(str(e)) from e
        finally:
            if finished_reason is None:
                self.abort(rid)
            self.tracked.pop(rid, None)
            reason = finished_reason or "abort"
            observed.end(reason, tracked.prefilled_by, tracked.kv_bytes, error)

    def _start_remote_prefill(self, rp: RemotePrefill, tracked: InFlightRequest) -> None:
        """The engine reserved the request's blocks: have a prefill node fill them."""
        if self.prefiller is None:  # reserved only when the request named candidates
            self.loop.submit(lambda: self.loop.engine.fail_remote_prefill(rp.request_id))
            return
        tracked.task = asyncio.ensure_future(self.prefiller.run(rp, tracked))

    def _chunk(
        self, update: RequestUpdate, tracked: InFlightRequest, first: bool
    ) -> node_pb2.TokenChunk:
        chunk = node_pb2.TokenChunk(
            token_ids=update.new_token_ids,
            logprobs=[logprob_to_proto(lp) for lp in update.new_logprobs if lp is not None],
        )
        if update.prompt_logprobs is not None:
            chunk.prompt_logprobs.extend(
                logprob_to_proto(lp) for lp in update.prompt_logprobs if lp is not None
            )
        if first:
            chunk.num_prompt_tokens = len(tracked.prompt_token_ids)
            chunk.num_cached_tokens = update.num_cached_tokens
            chunk.prefilled_by = tracked.prefilled_by
            chunk.kv_transfer_bytes = tracked.kv_bytes
            chunk.model_version = self.model_version
        if update.finished:
            chunk.finish_reason = finish_reason_to_proto(update.status)
        return chunk

    @property
    def kv_address(self) -> str:
        return self.prefiller.receiver.address if self.prefiller else ""

    # -- aborting ---------------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """End a request: stop its KV transfer first (no scatter into blocks about to be freed),
        then its prefill task, then the engine request; its stream ends with finish abort."""
        tracked = self.tracked.get(request_id)
        if tracked is not None:
            if self.prefiller is not None:
                self.prefiller.cancel_transfer(tracked)
            if tracked.task is not None:
                tracked.task.cancel()
        self.loop.abort(request_id)

    def in_flight(self) -> list[str]:
        return list(self.tracked)
