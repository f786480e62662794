"""POST /v1/embeddings (OpenAI's shape): the inputs tokenized off the event loop, embedded by a
prefill node (compute-bound work with no decode; the one with the fewest prompt tokens queued
from this gateway), or by a decode node where the deployment has no prefill node (aggregated).
Pooling is the gateway's --pooling; vectors are L2-normalized, as OpenAI's are. A node that
fails is marked so and the next one tried."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal

import grpc
import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, Field

from pdserve.gateway.context import GatewayContext
from pdserve.gateway.errors import ApiError
from pdserve.gateway.openai_api import TopLevelRequest
from pdserve.gateway.prompts import check_token_ids
from pdserve.gateway.registry import NodeState
from pdserve.v1 import common_pb2, node_pb2

MAX_INPUTS = 2048
"""OpenAI's limit on inputs per request."""
_ATTEMPTS = 3


class EmbeddingRequest(TopLevelRequest):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, lt=2**31)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _token_lists(ctx: GatewayContext, body: EmbeddingRequest) -> list[list[int]]:
    """The inputs as token-id lists (strings tokenized), checked; raises ApiError."""
    raw: Any = body.input
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise ApiError.bad_request("input must not be empty", "input")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    if len(raw) > MAX_INPUTS:
        raise ApiError.bad_request(f"at most {MAX_INPUTS} inputs per request", "input")
    tokenizer = ctx.tokenizer
    lists = []
    for item in raw:
        if isinstance(item, str):
            ids = tokenizer.encode(item)
        else:
            ids = check_token_ids(item, tokenizer.vocab_size, "input")
        if not ids:
            raise ApiError.bad_request("an input is empty", "input")
        lists.append(ids)
    limit = ctx.max_model_len()
    longest = max(len(ids) for ids in lists)
    if limit is not None and longest > limit:
        raise ApiError.bad_request(
            f"an input has {longest} tokens, more than the model's {limit}", "input"
        )
    return lists


def _candidates(ctx: GatewayContext) -> list[NodeState]:
    prefill = [n for n in ctx.registry.prefill_nodes if n.accepting]
    if prefill:
        return sorted(prefill, key=lambda n: n.pending_prefill_tokens)
    return sorted(
        (n for n in ctx.registry.decode_nodes if n.accepting), key=lambda n: n.num_inflight
    )


async def _embed(
    ctx: GatewayContext, lists: list[list[int]], deadline_s: float
) -> list[list[float]]:
    request = node_pb2.EmbedRequest(
        inputs=[common_pb2.TokenSequence(token_ids=ids) for ids in lists],
        pooling=ctx.config.pooling,
        normalize=True,
    )
    tokens = sum(len(ids) for ids in lists)
    failures = []
    for node in _candidates(ctx)[:_ATTEMPTS]:
        stub = node.prefill_stub if node.role == "prefill" else node.decode_stub
        node.pending_prefill_tokens += tokens
        node.num_inflight += 1
        try:
            reply = await stub.Embed(request, timeout=max(deadline_s - time.monotonic(), 0.1))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ApiError.bad_request(exc.details() or "invalid input", "input") from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ApiError.timeout("the embeddings did not finish in time") from exc
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                ctx.registry.mark_failed(node, f"Embed failed: {exc.code().name}")
            failures.append(f"{node.address}: {exc.code().name}")
            continue
        finally:
            node.pending_prefill_tokens -= tokens
            node.num_inflight -= 1
        return [list(e.values) for e in reply.embeddings]
    if not failures:
        raise ApiError.unavailable("no healthy node can compute embeddings")
    raise ApiError.unavailable("embedding failed on " + "; ".join(failures))


class EmbeddingRoutes:
    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def embeddings(self, body: EmbeddingRequest) -> EmbeddingResponse:
        ctx = self.ctx
        if ctx.check_model(body.model) is not None:
            raise ApiError.bad_request("embeddings with a LoRA adapter are not supported", "model")
        ticket = ctx.admission.admit()
        try:
            lists = await asyncio.to_thread(_token_lists, ctx, body)
            deadline = time.monotonic() + ctx.config.request_timeout_s
            vectors = await _embed(ctx, lists, deadline)
        finally:
            ticket.release()
        if body.dimensions is not None and vectors and body.dimensions != len(vectors[0]):
            raise ApiError.bad_request(
                f"this model's embeddings have {len(vectors[0])} dimensions; it does not "
                f"support dimensions={body.dimensions}",
                "dimensions",
            )
        data = [
            EmbeddingData(index=i, embedding=_encode(v, body.encoding_format))
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in lists)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=body.model, usage=usage)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes, base64
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def add_embedding_routes(app: FastAPI, ctx: GatewayContext) -> None:
    app.add_api_route("/v1/embeddings", EmbeddingRoutes(ctx).embeddings, methods=["POST"])
