"""The PrefillNode gRPC service: a thin adapter from the wire to the engine loop."""

from __future__ import annotations

import logging

import grpc

from pdserve.common.node import node_load
from pdserve.common.protocol import layout_from_proto, logprob_to_proto, sampling_params_from_proto
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestUpdate
from pdserve.engine.request import RequestStatus
from pdserve.kvtransfer.connector import KVPushConnector, PushTarget
from pdserve.kvtransfer.transport import KVTransferError
from pdserve.kvtransfer.wire import KVLayoutMismatch
from pdserve.prefill_node.telemetry import PrefillTelemetry
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(node_pb2_grpc.PrefillNodeServicer):
    """Prefills prompts and pushes their KV to the decode node that reserved the blocks."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        connector: KVPushConnector,
        node_id: str,
        model: str,
        timeout_s: float,
        telemetry: PrefillTelemetry,
    ) -> None:
        self.loop = engine_loop
        self.connector = connector
        self.node_id = node_id
        self.model = model
        self.timeout_s = timeout_s
        self.telemetry = telemetry
        self.accepting = True
        self.metrics_address = ""
        """host:port of this node's /metrics, reported in NodeLoad ("" = off)."""
        self._in_flight: set[str] = set()

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.PrefillResponse:
        rid = request.request_id
        if not self.accepting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "node is draining")
        try:
            self.connector.layout.check(layout_from_proto(request.kv_target.layout))
            params = sampling_params_from_proto(request.sampling_params)
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        target = request.kv_target
        prompt = list(request.prompt_token_ids)
        observed = self.telemetry.begin(rid, len(prompt), context.invocation_metadata())
        push = PushTarget(
            target.address, target.transfer_id, target.skip_blocks, observed.push_context()
        )
        stream = self.loop.open_stream(rid)
        self.connector.register(rid, push, len(prompt))
        self._in_flight.add(rid)

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                rid,
                prompt,
                params,
                cache_salt=request.cache_salt or None,
                seed=request.seed,
                prefill_only=True,
            )

        error: BaseException | None = None
        try:
            await self.loop.call(add)
            update = await stream.get(self.timeout_s)
            assert isinstance(update, RequestUpdate)  # a prefill node reserves no remote KV
            if update.status is not RequestStatus.FINISHED_PREFILLED:
                await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} was aborted")
            observed.first_token(update.num_cached_tokens, update.scheduled_s)
            try:
                stats = await self.connector.sent(rid, self.timeout_s)
            except (KVTransferError, TimeoutError):
                observed.transfer_failed()
                raise
            observed.sent(stats, target.address)
        except ValueError as e:
            error = e
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (KVTransferError, TimeoutError) as e:
            error = e
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {e}")
        except BaseException as e:  # aborted, cancelled: recorded on the span, then re-raised
            error = e
            raise
        finally:
            self._in_flight.discard(rid)
            self.connector.unregister(rid)
            self.loop.abort(rid)  # no-op when it already ended after its first token
            observed.end(error)
        response = node_pb2.PrefillResponse(
            first_token_id=update.new_token_ids[0],
            num_cached_tokens=update.num_cached_tokens,
            kv_bytes=stats.bytes,
            kv_seconds=stats.seconds,
        )
        if update.new_logprobs and update.new_logprobs[0] is not None:
            response.first_logprob.CopyFrom(logprob_to_proto(update.new_logprobs[0]))
        return response

    def abort_all(self) -> None:
        for request_id in list(self._in_flight):
            self.loop.abort(request_id)

    async def Abort(
        self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AbortResponse:
        self.loop.abort(request.request_id)
        return node_pb2.AbortResponse()

    async def GetLoad(
        self, request: node_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeLoad:
        return node_load(
            self.loop,
            self.node_id,
            "prefill",
            self.model,
            self.accepting,
            metrics_address=self.metrics_address,
        )
