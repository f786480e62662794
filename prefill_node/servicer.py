"""The PrefillNode gRPC service: a thin adapter from the wire to the engine loop."""

from __future__ import annotations

import logging

import grpc

from pdserve.common.node_service import NodeError, NodeService
from pdserve.common.protocol import layout_from_proto, logprob_to_proto, sampling_params_from_proto
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestUpdate
from pdserve.engine.request import RequestStatus
from pdserve.kvtransfer.connector import KVPushConnector, PushTarget
from pdserve.kvtransfer.transport import KVTransferError
from pdserve.prefill_node.telemetry import PrefillTelemetry
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(NodeService, node_pb2_grpc.PrefillNodeServicer):
    """Prefills prompts and pushes their KV to the decode node that reserved the blocks."""

    role = "prefill"

    def __init__(
        self,
        engine_loop: EngineLoop,
        connector: KVPushConnector,
        node_id: str,
        model: str,
        timeout_s: float,
        telemetry: PrefillTelemetry,
        metrics_address: str = "",
    ) -> None:
        super().__init__(engine_loop, node_id, model, metrics_address)
        self.connector = connector
        self.timeout_s = timeout_s
        self.telemetry = telemetry
        self._in_flight: set[str] = set()

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.PrefillResponse:
        rid = request.request_id
        self.check_accepting()
        # a mismatch is FAILED_PRECONDITION (never garbage KV), bad params INVALID_ARGUMENT
        self.connector.layout.check(layout_from_proto(request.kv_target.layout))
        params = sampling_params_from_proto(request.sampling_params)
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
                raise NodeError.aborted(f"prefill of {rid} was aborted")
            observed.first_token(update.num_cached_tokens, update.scheduled_s)
            try:
                stats = await self.connector.sent(rid, self.timeout_s)
            except (KVTransferError, TimeoutError):
                observed.transfer_failed()
                raise
            observed.sent(stats, target.address)
        except (KVTransferError, TimeoutError) as e:
            error = e
            raise NodeError.unavailable(f"KV push failed: {e}") from e
        except BaseException as e:  # bad input, aborted, cancelled: on the span, then re-raised
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

    def in_flight(self) -> list[str]:
        return list(self._in_flight)
