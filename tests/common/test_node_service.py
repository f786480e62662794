"""The node's error interceptor over a real grpc.aio server on 127.0.0.1: what an RPC method
raises becomes the status its caller sees, and a caller that leaves a stream closes the
servicer's generator at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.common.node import NodeServer
from pdserve.common.node_service import NodeError, status_of
from pdserve.kvtransfer.wire import KVLayoutMismatch
from pdserve.v1 import node_pb2, node_pb2_grpc

SERVICE = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name


class Raising(node_pb2_grpc.DecodeNodeServicer):
    """Raises what the request id names; streams until cancelled for "forever"."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def Generate(self, request, context):
        rid = request.request_id
        if rid == "bad":
            raise ValueError("prompt is empty")
        if rid == "mismatch":
            raise KVLayoutMismatch("dtype float32 != bfloat16")
        yield node_pb2.TokenChunk(token_ids=[1])
        if rid == "late":
            raise NodeError.deadline("no token within the deadline")
        try:
            while rid == "forever":
                yield node_pb2.TokenChunk(token_ids=[2])
                await asyncio.sleep(0.01)
        finally:
            self.closed.set()

    async def Abort(self, request, context):
        if request.request_id == "draining":
            raise NodeError.draining()
        raise KeyError(request.request_id)  # a bug: INTERNAL


def test_status_of_maps_by_type():
    assert status_of(NodeError.invalid("x")) == (grpc.StatusCode.INVALID_ARGUMENT, "x")
    assert status_of(KVLayoutMismatch("m"))[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(ValueError("v")) == (grpc.StatusCode.INVALID_ARGUMENT, "v")
    code, details = status_of(ZeroDivisionError("z"))
    assert code is grpc.StatusCode.INTERNAL and "ZeroDivisionError" in details


def test_errors_become_status_codes_and_left_streams_close():
    async def main() -> None:
        servicer = Raising()
        server = NodeServer("127.0.0.1", 0, [SERVICE])
        node_pb2_grpc.add_DecodeNodeServicer_to_server(servicer, server.server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = node_pb2_grpc.DecodeNodeStub(channel)

                async def generate(rid: str) -> tuple[list[int], grpc.StatusCode, str]:
                    tokens = []
                    try:
                        async for chunk in stub.Generate(
                            node_pb2.DecodeRequest(request_id=rid), timeout=10
                        ):
                            tokens += chunk.token_ids
                    except grpc.aio.AioRpcError as e:
                        return tokens, e.code(), e.details()
                    return tokens, grpc.StatusCode.OK, ""

                assert await generate("bad") == (
                    [],
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "prompt is empty",
                )
                assert (await generate("mismatch"))[1] is grpc.StatusCode.FAILED_PRECONDITION
                assert await generate("late") == (
                    [1],
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "no token within the deadline",
                )
                assert await generate("ok") == ([1], grpc.StatusCode.OK, "")
                for rid, code in (
                    ("draining", grpc.StatusCode.RESOURCE_EXHAUSTED),
                    ("x", grpc.StatusCode.INTERNAL),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Abort(node_pb2.AbortRequest(request_id=rid), timeout=10)
                    assert info.value.code() is code
                call = stub.Generate(node_pb2.DecodeRequest(request_id="forever"), timeout=10)
                async for _ in call:
                    break
                call.cancel()
                await asyncio.wait_for(servicer.closed.wait(), 5)
                # health checking passes through the interceptor untouched
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())
