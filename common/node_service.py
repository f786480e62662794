"""What the prefill and decode servicers share: the RPCs every node answers (GetLoad, Abort),
draining, and one interceptor that turns errors into gRPC status codes.

A servicer method raises; it never calls context.abort itself. `NodeError` carries its own
status code; the other errors a node expects map by type (`_STATUS_BY_TYPE`): a request that
fails validation (ValueError, raised by the engine or the proto conversions) is
INVALID_ARGUMENT, a KV layout that does not match is FAILED_PRECONDITION. Anything else is a bug
and reaches the client as INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import SamplingParams
from pdserve.kvtransfer.wire import KVLayoutMismatch
from pdserve.v1 import node_pb2

logger = logging.getLogger(__name__)


class NodeError(Exception):
    """A request failed in a way its caller is told about, with the gRPC status to send."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def draining(cls) -> NodeError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, "node is draining")

    @classmethod
    def invalid(cls, message: str) -> NodeError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def aborted(cls, message: str) -> NodeError:
        return cls(grpc.StatusCode.ABORTED, message)

    @classmethod
    def unavailable(cls, message: str) -> NodeError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)

    @classmethod
    def deadline(cls, message: str) -> NodeError:
        return cls(grpc.StatusCode.DEADLINE_EXCEEDED, message)


_STATUS_BY_TYPE: list[tuple[type[Exception], grpc.StatusCode]] = [
    (KVLayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),  # before ValueError: a subclass
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details a caller gets for error."""
    if isinstance(error, NodeError):
        return error.code, error.message
    for kind, code in _STATUS_BY_TYPE:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


async def _abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    code, details = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in an RPC", exc_info=error)
    await context.abort(code, details)


def _unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await _abort_with(context, e)

    return run


def _stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # aclosing: a caller that leaves closes the servicer's generator at once (its
            # cleanup, e.g. aborting the request, must not wait for garbage collection)
            async with contextlib.aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await _abort_with(context, e)

    return run


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps what a node's RPC methods raise to gRPC status codes (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # our RPCs take one request; health/reflection pass through as is
        codec = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_stream(handler.unary_stream), **codec)
        return handler


def node_load(
    loop: EngineLoop,
    node: str,
    role: str,
    model: str,
    accepting: bool,
    kv_address: str = "",
    metrics_address: str = "",
    model_version: str = "",
) -> node_pb2.NodeLoad:
    """The node's load report (the engine's load snapshot, safe from the event loop)."""
    engine = loop.engine
    load = engine.load()
    return node_pb2.NodeLoad(
        node_id=node,
        role=role,
        model=model,
        num_running=load.num_running,
        num_waiting=load.num_waiting + load.num_awaiting_kv,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        block_size=engine.cache_config.block_size,
        max_model_len=engine.max_model_len,
        accepting=accepting,
        generation_tokens_per_s=loop.generation_tokens_per_s(),
        kv_address=kv_address,
        num_preemptions=load.num_preemptions,
        metrics_address=metrics_address,
        model_version=model_version,
    )


class NodeService:
    """The RPCs and state every node's servicer has. Subclasses (one per role, also deriving
    from the generated servicer) say which requests are theirs: `_in_flight` holds the ids
    that abort_all() ends on shutdown."""

    role = ""

    def __init__(
        self,
        engine_loop: EngineLoop,
        node_id: str,
        model: str,
        metrics_address: str = "",
        model_version: str = "",
    ) -> None:
        self.loop = engine_loop
        self.node_id = node_id
        self.model = model
        self.model_version = model_version
        """The weights' version (NodeParts.model_version), reported in NodeLoad."""
        self.metrics_address = metrics_address
        """host:port of this node's /metrics, reported in NodeLoad ("" = off)."""
        self.accepting = True
        """False once the node drains: new requests are refused (RESOURCE_EXHAUSTED)."""

    def check_accepting(self) -> None:
        if not self.accepting:
            raise NodeError.draining()

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output grammar on a worker thread (cached by
        spec), so that add_request on the engine thread finds it ready; ValueError when bad."""
        spec = params.structured_output
        grammars = self.loop.engine.grammars
        if spec is not None and not grammars.is_cached(spec):
            await asyncio.to_thread(grammars.compile, spec)

    @property
    def kv_address(self) -> str:
        """Where this node receives KV ("" for roles that do not)."""
        return ""

    def in_flight(self) -> list[str]:
        """Ids of the requests this node is working on."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """End a request; its stream ends with a finish of abort."""
        self.loop.abort(request_id)

    def abort_all(self) -> None:
        for request_id in self.in_flight():
            self.abort(request_id)

    async def Embed(
        self, request: node_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.EmbedResponse:
        """Pooled embeddings, computed on the engine thread between steps (engine.embed);
        a bad input is INVALID_ARGUMENT."""
        self.check_accepting()
        inputs = [list(sequence.token_ids) for sequence in request.inputs]
        pooling, normalize = request.pooling or "last", request.normalize
        vectors = await self.loop.call(lambda engine: engine.embed(inputs, pooling, normalize))
        return node_pb2.EmbedResponse(embeddings=[node_pb2.Embedding(values=v) for v in vectors])

    async def GetLoad(
        self, request: node_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.NodeLoad:
        return node_load(
            self.loop,
            self.node_id,
            self.role,
            self.model,
            self.accepting,
            self.kv_address,
            self.metrics_address,
            self.model_version,
        )

    async def Abort(
        self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AbortResponse:
        self.abort(request.request_id)
        return node_pb2.AbortResponse()
