"""The public gRPC front: the Gateway service (Generate, ListModels) over the same request path
as the REST front, plus the standard health service and server reflection."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.common import tracing
from pdserve.common.grpc_messages import MalformedRequestInterceptor
from pdserve.gateway.admission import Ticket
from pdserve.gateway.context import GatewayContext
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.openai_api import MAX_N
from pdserve.gateway.prompts import chat_prompt_ids, check_token_ids
from pdserve.gateway.request_trace import RequestTrace
from pdserve.gateway.sampling import check_min_tokens, check_sampling_params, fit_max_tokens
from pdserve.gateway.sequence import CompletionDelta
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

MAX_CLIENT_REQUEST_ID_CHARS = 256
"""Longest request_id a client may send (kept as an attribute, never as pdserve's own id)."""
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_GENERATE_METHOD = f"{GATEWAY_SERVICE}/Generate"
HEALTH_UPDATE_INTERVAL_S = 0.5
DEFAULT_MAX_TOKENS = 16
"""SamplingParams.max_tokens when unset (the proto's documented default)."""
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
}


def _prompt_ids(ctx: GatewayContext, request: gateway_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return check_token_ids(ctx.tokenizer.encode(request.text), ctx.tokenizer.vocab_size, kind)
    if kind == "token_ids":
        return check_token_ids(request.token_ids.ids, ctx.tokenizer.vocab_size, kind)
    if kind == "chat":
        messages = request.chat.messages
        if not messages:
            raise ApiError.bad_request("chat.messages must not be empty", "chat")
        for m in messages:
            if m.role not in _CHAT_ROLES:
                raise ApiError.bad_request(f"unknown chat role {m.role!r}", "chat")
        return chat_prompt_ids(
            ctx.tokenizer, [{"role": m.role, "content": m.content} for m in messages]
        )
    raise ApiError.bad_request("a prompt (text, chat or token_ids) is required", "prompt")


def prepare_generate(
    ctx: GatewayContext, request: gateway_pb2.GenerateRequest
) -> GenerationRequest:
    """Check, tokenize and size a gRPC GenerateRequest (raises ApiError)."""
    lora = ctx.check_model(request.model)
    max_model_len = ctx.check_decode_available()
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise ApiError.bad_request(f"n must be in [1, {MAX_N}], got {n}", "n")
    params = common_pb2.SamplingParams()
    params.CopyFrom(request.sampling_params)
    check_sampling_params(params)
    prompt_ids = _prompt_ids(ctx, request)
    requested = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    params.max_tokens = fit_max_tokens(requested, len(prompt_ids), max_model_len, "prompt")
    check_min_tokens(params)
    if len(request.request_id) > MAX_CLIENT_REQUEST_ID_CHARS:
        raise ApiError.bad_request(
            f"request_id may have at most {MAX_CLIENT_REQUEST_ID_CHARS} characters", "request_id"
        )
    # The id inside pdserve is always ours (unique, fixed size): a client's id is echoed in
    # the responses and traced, never used to key anything, so two calls may share one.
    return ctx.new_request(
        f"gen-{uuid.uuid4().hex}", prompt_ids, params, n, request.cache_salt, lora=lora
    )


def _response(request_id: str, delta: CompletionDelta) -> gateway_pb2.GenerateResponse:
    stop_reason = "" if delta.stop_reason is None else str(delta.stop_reason)
    return gateway_pb2.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=delta.logprobs,
        finish_reason=_FINISH_REASONS[delta.finish_reason],
        stop_reason=stop_reason,
        prompt_tokens=delta.num_prompt_tokens,
        cached_tokens=delta.num_cached_tokens,
        completion_tokens=delta.num_output_tokens,
        prompt_logprobs=delta.prompt_logprobs or [],
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Thin adapter from the Gateway service to the request path."""

    def __init__(self, ctx: GatewayContext) -> None:
        self._ctx = ctx

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        parent = tracing.context_from_grpc(context.invocation_metadata())
        attributes = {"rpc.system": "grpc", "rpc.method": _GENERATE_METHOD}
        trace = RequestTrace(_GENERATE_METHOD, parent, attributes)
        ticket: Ticket | None = None
        try:
            ticket = self._ctx.admission.admit()
            generation = await asyncio.to_thread(
                trace.prepare, lambda: prepare_generate(self._ctx, request)
            )
            if request.request_id and trace.span.is_recording():
                trace.span.set_attribute("pdserve.client_request_id", request.request_id)
            reply_id = request.request_id or generation.request_id
            deltas = self._ctx.generator.generate(generation)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield _response(reply_id, delta)
        except ApiError as exc:
            trace.fail(exc)
            await context.abort(exc.grpc_code, exc.message)
        finally:
            if ticket is not None:
                ticket.release()
            trace.end()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        max_model_len = self._ctx.max_model_len() or 0
        models = [
            gateway_pb2.ModelInfo(id=name, max_model_len=max_model_len)
            for name in self._ctx.model_names
        ]
        models += [
            gateway_pb2.ModelInfo(
                id=lora.name, max_model_len=max_model_len, parent=self._ctx.model_name
            )
            for lora in self._ctx.loras.adapters
        ]
        return gateway_pb2.ListModelsResponse(models=models)


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """--api-key on the Gateway service: metadata `authorization: Bearer <key>` (compared in
    constant time), else UNAUTHENTICATED; health and reflection stay open."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or incorrect API key")

        async def refuse_stream(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or incorrect API key")
            yield  # pragma: no cover - abort raises

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse_stream)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        method = handler_call_details.method
        if not method.startswith(f"/{GATEWAY_SERVICE}/"):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(handler_call_details)
        return self._refuse_stream if method.endswith("/Generate") else self._refuse


class GrpcFront:
    """The gRPC server: Gateway, grpc.health.v1.Health (SERVING exactly when /health is 200)
    and reflection."""

    def __init__(
        self,
        ctx: GatewayContext,
        host: str,
        port: int,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self._ctx = ctx
        self._credentials = credentials
        self._address = f"{host}:{port}"
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if ctx.config.api_key:  # outermost: no parsing for a caller without the key
            interceptors.insert(0, _ApiKeyInterceptor(ctx.config.api_key))
        limit = ctx.config.max_request_body_bytes
        self._server = grpc.aio.server(
            interceptors=interceptors, options=[("grpc.max_receive_message_length", limit)]
        )
        self._health = health.aio.HealthServicer()
        self._health_task: asyncio.Task[None] | None = None
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(ctx), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        services = (GATEWAY_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self._server)

    async def start(self) -> int:
        """Listen; returns the bound port."""
        if self._credentials is None:
            port = self._server.add_insecure_port(self._address)
        else:
            port = self._server.add_secure_port(self._address, self._credentials)
        if port == 0:
            raise OSError(f"cannot listen on {self._address} for gRPC")
        await self._update_health()
        await self._server.start()
        self._health_task = asyncio.create_task(self._track_health(), name="grpc-health")
        return port

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, then stop, letting calls in flight run for grace_s."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)

    async def _track_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_UPDATE_INTERVAL_S)
            await self._update_health()

    async def _update_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self._ctx.is_ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GATEWAY_SERVICE):
            await self._health.set(service, status)
