"""Malformed request messages are INVALID_ARGUMENT, not UNKNOWN.

grpc-python answers a request whose bytes do not parse as the method's message with UNKNOWN
("Exception deserializing request!") before any handler runs. MalformedRequestInterceptor
wraps each unary-request handler's deserializer: a parse failure becomes a marker the wrapped
handler turns into INVALID_ARGUMENT naming the method, as every other bad input is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Malformed(e)

    return parse


def _message(method: str, request: _Malformed) -> str:
    return f"{method}: malformed request message ({type(request.error).__name__})"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        codec = dict(
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **codec)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))
                async for response in inner_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(stream, **codec)
        return handler
