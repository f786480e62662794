"""The PrefillNode gRPC service: a thin adapter from the wire to the engine loop."""

from __future__ import annotations

import ipaddress
import logging

import grpc

from pdserve.common.node_service import NodeError, NodeService
from pdserve.common.protocol import (
    layout_from_proto,
    logprob_to_proto,
    lora_from_proto,
    sampling_params_from_proto,
)
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestUpdate
from pdserve.engine.request import RequestStatus
from pdserve.engine.utils import cdiv
from pdserve.kvtransfer.connector import KVPushConnector, PushTarget
from pdserve.kvtransfer.transport import KVTransferError, split_address
from pdserve.prefill_node.telemetry import PrefillTelemetry
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

MAX_TRANSFER_ID_BYTES = 128


def peer_host(peer: str) -> str | None:
    """The IP address of a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"), or
    None for another kind (unix sockets)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return None


def _same_host(a: str, b: str) -> bool:
    try:
        ip_a, ip_b = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return a == b
    if ip_a.is_loopback and ip_b.is_loopback:
        return True
    mapped = getattr(ip_b, "ipv4_mapped", None)  # a v4 caller seen on a dual-stack socket
    return ip_a == ip_b or (mapped is not None and ip_a == mapped)


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
        kv_target_hosts: str = "caller",
        model_version: str = "",
    ) -> None:
        super().__init__(engine_loop, node_id, model, metrics_address, model_version)
        self.connector = connector
        self.timeout_s = timeout_s
        self.kv_target_hosts = kv_target_hosts
        self.telemetry = telemetry
        self._in_flight: set[str] = set()

    def _check_target(self, target: node_pb2.KVTarget, prompt_len: int, peer: str) -> None:
        """INVALID_ARGUMENT unless the KV target is one this node may push to, for a block
        range the prompt has (checked before anything is computed or connected to)."""
        num_blocks = cdiv(prompt_len, self.connector.layout.block_size)
        if not 0 <= target.skip_blocks < num_blocks:
            raise NodeError.invalid(
                f"kv_target.skip_blocks={target.skip_blocks} outside [0, {num_blocks}) "
                f"for a prompt of {prompt_len} tokens"
            )
        if not 0 < len(target.transfer_id.encode()) <= MAX_TRANSFER_ID_BYTES:
            raise NodeError.invalid(
                f"kv_target.transfer_id must be 1..{MAX_TRANSFER_ID_BYTES} bytes"
            )
        scheme = target.address.partition("://")[0]
        if scheme == "inproc":  # tests: a receiver in this very process
            return
        try:
            host, _ = split_address(target.address, scheme)
        except ValueError as e:
            raise NodeError.invalid(f"kv_target.address: {e}") from None
        if self.kv_target_hosts == "any":
            return
        if self.kv_target_hosts == "caller":
            caller = peer_host(peer)
            if caller is None or not _same_host(host, caller):
                raise NodeError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"KV target host {host} is not the caller's ({caller}); see --kv-target-hosts",
                )
            return
        allowed = [h.strip() for h in self.kv_target_hosts.split(",") if h.strip()]
        if not any(_same_host(host, h) for h in allowed):
            raise NodeError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"KV target host {host} is not in --kv-target-hosts",
            )

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.PrefillResponse:
        rid = request.request_id
        self.check_accepting()
        target = request.kv_target
        prompt = list(request.prompt_token_ids)
        self._check_target(target, len(prompt), context.peer())
        # a mismatch is FAILED_PRECONDITION (never garbage KV), bad params INVALID_ARGUMENT
        lora = lora_from_proto(request.lora) if request.HasField("lora") else None
        lora_name = lora.lora_name if lora is not None else ""
        self.connector.layout.with_adapter(lora_name).check(layout_from_proto(target.layout))
        params = sampling_params_from_proto(request.sampling_params)
        await self.compile_grammar(params)
        observed = self.telemetry.begin(rid, len(prompt), context.invocation_metadata())
        push = PushTarget(
            target.address,
            target.transfer_id,
            target.skip_blocks,
            observed.push_context(),
            target.token,
            lora_name,
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
                lora_request=lora,  # ValueError (INVALID_ARGUMENT) if it cannot be loaded
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
