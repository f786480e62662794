"""The OpenAI REST front (FastAPI): /v1/models, /v1/completions, /v1/chat/completions and
/health. Every error has OpenAI's shape; streams are server-sent events ending in [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import text_format
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve.common import metrics, tracing
from pdserve.gateway.admission import Ticket
from pdserve.gateway.auth import ApiKeyMiddleware
from pdserve.gateway.body_limit import BodyLimitMiddleware
from pdserve.gateway.chat import chat_response, chat_stream, prepare_chat
from pdserve.gateway.completions import completion_response, completion_stream, prepare_completion
from pdserve.gateway.context import GatewayContext
from pdserve.gateway.dashboard import add_dashboard_routes
from pdserve.gateway.embeddings import add_embedding_routes
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.lora import add_lora_routes
from pdserve.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pdserve.gateway.request_trace import RequestTrace
from pdserve.gateway.sequence import CompletionDelta
from pdserve.gateway.vllm_api import add_vllm_routes

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request checks whether its client is still there."""

Deltas = AsyncIterator[CompletionDelta]


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's error location as OpenAI writes param ("messages.[0].role"): union branch
    tags (str, list[int], function-after[...]) and the leading "body" are left out."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part != "body" and part not in _UNION_TAGS and "[" not in part:
            parts.append(part)
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the first offending field. A field of union type
    fails once per branch: its messages are joined, and our own checks' messages win."""
    errors = list(exc.errors())
    if not errors:
        return ApiError.bad_request("invalid request")
    if errors[0].get("type") == "json_invalid":
        return ApiError.bad_request(f"the request body is not valid JSON: {errors[0]['msg']}")
    paths = [_param_path(tuple(e.get("loc", ()))) for e in errors]
    param = paths[0]
    related = [
        (path, e)
        for path, e in zip(paths, errors, strict=True)
        if param is None or path == param or (path or "").startswith(f"{param}.")
    ]
    custom = [(path, e) for path, e in related if e.get("type") == "value_error"]
    if custom:
        param, chosen = custom[0][0], [custom[0][1]]
    else:
        chosen = [e for path, e in related if path == param]
    messages = dict.fromkeys(str(e.get("msg", "")).removeprefix("Value error, ") for e in chosen)
    message = " or ".join(messages)
    return ApiError.bad_request(f"{param}: {message}" if param else message, param)


class EventStreamResponse(StreamingResponse):
    """A server-sent-event stream that, however it ends (finished, client gone, server
    stopping), closes its sources, which cancels the decode calls, and frees its ticket."""

    def __init__(
        self,
        frames: AsyncIterator[str],
        closers: list[Callable[[], Awaitable[None]]],
        ticket: Ticket,
        trace: RequestTrace,
    ) -> None:
        super().__init__(
            frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._closers = [self.body_iterator.aclose, *closers]  # type: ignore[union-attr]
        self._ticket = ticket
        self._trace = trace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                for close in self._closers:
                    await close()
            finally:
                self._ticket.release()
                self._trace.end()


async def _sse_frames(events: AsyncIterator[str], trace: RequestTrace) -> AsyncIterator[str]:
    """`data: {json}` per event, an error event if the request fails, then `data: [DONE]`."""
    try:
        async for payload in events:
            yield f"data: {payload}\n\n"
    except ApiError as exc:
        trace.fail(exc)
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:  # still end the stream the way clients expect
        logger.exception("stream failed")
        trace.fail(exc)
        yield f"data: {json.dumps(ApiError.internal(repr(exc)).body())}\n\n"
    yield "data: [DONE]\n\n"


class RestFront:
    """Handlers of the REST routes over one GatewayContext."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def health(self) -> Response:
        """200 while requests can be served (a decode node accepts and the gateway is not
        draining), else 503; the body tells "ok" from "degraded" (e.g. no prefill node: slower,
        local prefill) with per-tier counts, for people and dashboards, not for probes."""
        ready = self.ctx.is_ready()
        detail = self.ctx.registry.tier_status()
        if self.ctx.admission.draining:
            detail["status"] = "draining"
        elif not ready:
            detail["status"] = "unavailable"
        return JSONResponse(detail, status_code=200 if ready else 503)

    async def models(self) -> ModelList:
        ctx = self.ctx
        created = int(time.time())
        cards = [
            ModelCard(
                id=name, created=created, root=ctx.config.model, max_model_len=ctx.max_model_len()
            )
            for name in ctx.model_names
        ]
        cards += [  # vLLM's: an adapter's parent is the base model, its root its directory
            ModelCard(
                id=lora.name,
                created=created,
                root=lora.path,
                parent=ctx.model_name,
                max_model_len=ctx.max_model_len(),
            )
            for lora in ctx.loras.adapters
        ]
        return ModelList(data=cards)

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        trace, ticket, request = await self._begin(raw, lambda: prepare_completion(self.ctx, body))
        deltas = self.ctx.generator.generate(request)
        if body.stream:
            events = completion_stream(self.ctx, body, request, deltas)
            return self._stream(events, deltas, ticket, trace)
        work = completion_response(self.ctx, body, request, deltas)
        return await self._respond(raw, request, work, deltas, ticket, trace)

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        trace, ticket, request = await self._begin(raw, lambda: prepare_chat(self.ctx, body))
        deltas = self.ctx.generator.generate(request)
        if body.stream:
            return self._stream(chat_stream(self.ctx, body, request, deltas), deltas, ticket, trace)
        work = chat_response(self.ctx, body, request, deltas)
        return await self._respond(raw, request, work, deltas, ticket, trace)

    async def _begin(
        self, raw: Request, prepare: Callable[[], GenerationRequest]
    ) -> tuple[RequestTrace, Ticket, GenerationRequest]:
        """Open the request's trace, admit and prepare it: the chat template and tokenization
        run on a worker thread, so a huge prompt never holds the event loop (every other
        request's tokens stream meanwhile). On failure (an ApiError: full, bad input) nothing
        stays open."""
        path = raw.url.path
        attributes = {"http.request.method": "POST", "http.route": path}
        trace = RequestTrace(f"POST {path}", tracing.extract(raw.headers), attributes)
        ticket: Ticket | None = None
        try:
            ticket = self.ctx.admission.admit()
            request = await asyncio.to_thread(trace.prepare, prepare)
            if self.ctx.config.enable_log_requests:
                log_request(request, self.ctx.config.max_log_len)
            return trace, ticket, request
        except BaseException as exc:
            if ticket is not None:
                ticket.release()
            trace.fail(exc)
            trace.end()
            raise

    @staticmethod
    def _stream(
        events: AsyncIterator[str], deltas: Deltas, ticket: Ticket, trace: RequestTrace
    ) -> Response:
        closers = [events.aclose, deltas.aclose]  # type: ignore[attr-defined]
        return EventStreamResponse(_sse_frames(events, trace), closers, ticket, trace)

    @staticmethod
    async def _respond(
        raw: Request,
        request: GenerationRequest,
        work: Coroutine[Any, Any, BaseModel],
        deltas: Deltas,
        ticket: Ticket,
        trace: RequestTrace,
    ) -> Response:
        """Await work, unless the client goes away first: then cancel it (which cancels the
        decode calls) and answer no one."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return JSONResponse(task.result().model_dump(mode="json"))
                if await raw.is_disconnected():
                    logger.info("client of %s went away; cancelling it", request.request_id)
                    return Response(status_code=499)
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            try:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ApiError):
                        await task
                await deltas.aclose()  # type: ignore[attr-defined]
            finally:
                ticket.release()
                trace.end()


def log_request(request: GenerationRequest, max_log_len: int | None) -> None:
    """--enable-log-requests: one INFO line per request, its prompt cut to max_log_len ids."""
    prompt = request.prompt_token_ids
    shown = prompt if max_log_len is None else prompt[:max_log_len]
    more = f" (+{len(prompt) - len(shown)} more)" if len(shown) < len(prompt) else ""
    params = text_format.MessageToString(request.params, as_one_line=True)
    logger.info(
        "request %s: n=%d, %d prompt tokens %s%s, params: %s",
        request.request_id,
        request.n,
        len(prompt),
        shown,
        more,
        params,
    )


def node_scrape_targets(ctx: GatewayContext) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: the /metrics of every node that reported one."""
    return [
        {"targets": [node.load.metrics_address], "labels": {"node_address": node.address}}
        for node in ctx.registry.nodes
        if node.load is not None and node.load.metrics_address
    ]


def build_app(ctx: GatewayContext) -> FastAPI:
    """The FastAPI application of the REST front."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    front = RestFront(ctx)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        error = ApiError(status, str(exc.detail), "invalid_request_error")
        return error_response(error)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(ApiError.internal(f"internal error: {exc!r}"))

    async def prometheus_metrics() -> Response:
        body = metrics.exposition(ctx.metrics.registry)
        return Response(body, media_type=metrics.CONTENT_TYPE)

    async def scrape_targets() -> JSONResponse:
        return JSONResponse(node_scrape_targets(ctx))

    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    app.add_api_route("/metrics/targets", scrape_targets, methods=["GET"])
    add_dashboard_routes(app, ctx)
    add_vllm_routes(app, ctx)
    add_embedding_routes(app, ctx)
    if ctx.config.allow_runtime_lora_updating:
        add_lora_routes(app, ctx.loras)
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/v1/completions", front.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", front.chat_completions, methods=["POST"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.config.max_request_body_bytes)
    if ctx.config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ctx.config.allowed_origins),
            allow_credentials=ctx.config.allow_credentials,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    if ctx.config.api_key:  # outermost: nothing is read for a caller without the key
        app.add_middleware(
            ApiKeyMiddleware, api_key=ctx.config.api_key, root_path=ctx.config.root_path
        )
    return app
