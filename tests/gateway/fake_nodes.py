"""Fake decode and prefill nodes: real grpc.aio servers on 127.0.0.1 with deterministic
behaviour, for testing the gateway without an engine.

The fake decode node "samples" the token at absolute position p as
script[(p + seed) % len(script)] (seed 0 when greedy), like the engine a pure function of
(seed, position), so a resubmitted sequence continues exactly. It honours max_tokens,
min_tokens, eos (unless ignore_eos), stop_token_ids and max_model_len, reports prefix-cache hits
for prompts it has seen, and records every call and every cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import common_pb2, node_pb2, node_pb2_grpc

VOCAB_SIZE = 2048
EOS_TOKEN_ID = 3


@dataclass
class DecodeBehaviour:
    """How a FakeDecodeNode answers; tests change it between (or during) requests."""

    script: list[int]
    block_size: int = 16
    max_model_len: int = 512
    token_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    reject_with: grpc.StatusCode | None = None
    """Refuse every Generate call with this code."""
    die_after_tokens: int | None = None
    """Stop the whole server after streaming this many tokens of a call."""
    hang_after_tokens: int | None = None
    """After streaming this many tokens of a call, hang: the call sends nothing more and the
    node's GetLoad answers nothing (as a SIGSTOPped process) until `hung` is cleared."""
    stall_after_tokens: int | None = None
    """After streaming this many tokens of a call, that call sends nothing more; GetLoad
    keeps answering (a healthy-looking node whose engine is stuck)."""
    accepting: bool = True
    extra_load: int = 0
    """Added to num_running in GetLoad (steers the gateway's router away)."""


def script_token(script: Sequence[int], position: int, seed: int) -> int:
    return script[(position + seed) % len(script)]


def expected_tokens(
    script: Sequence[int],
    prompt_len: int,
    seed: int,
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    eos_token_id: int | None = EOS_TOKEN_ID,
    max_model_len: int = 512,
) -> list[int]:
    """The tokens a FakeDecodeNode generates (min_tokens 0, no stop strings)."""
    out: list[int] = []
    while True:
        token = script_token(script, prompt_len + len(out), seed)
        out.append(token)
        if token == eos_token_id or token in stop_token_ids:
            return out
        if len(out) == max_tokens or prompt_len + len(out) >= max_model_len:
            return out


def _logprob(position: int) -> float:
    return -0.5 - (position % 5) * 0.25


def fake_logprobs(token: int, position: int, num_top: int) -> common_pb2.TokenLogprob:
    """The logprobs a FakeDecodeNode reports: the sampled token is the most likely."""
    lp = _logprob(position)
    top = [
        common_pb2.TopLogprob(token_id=(token + j) % VOCAB_SIZE, logprob=lp - j)
        for j in range(num_top)
    ]
    return common_pb2.TokenLogprob(token_id=token, logprob=lp, rank=1, top=top)


@dataclass
class CallRecord:
    request: node_pb2.DecodeRequest
    num_tokens_sent: int = 0
    cancelled: bool = False
    finished: bool = False


@dataclass
class FakeDecodeNode(node_pb2_grpc.DecodeNodeServicer):
    """DecodeNode servicer; see the module docstring."""

    behaviour: DecodeBehaviour
    node_id: str = "decode"
    calls: list[CallRecord] = field(default_factory=list)
    aborted_ids: list[str] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    hung: bool = False
    _seen_prefixes: set[tuple[int, ...]] = field(default_factory=set)
    _active: int = 0

    def _cached_tokens(self, prompt: list[int]) -> int:
        size = self.behaviour.block_size
        cached = 0
        while cached + size <= len(prompt) - 1 and tuple(prompt[: cached + size]) in (
            self._seen_prefixes
        ):
            cached += size
        for end in range(size, len(prompt) + 1, size):
            self._seen_prefixes.add(tuple(prompt[:end]))
        return cached

    async def Generate(self, request: node_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        record = CallRecord(request)
        self.calls.append(record)
        context.add_done_callback(lambda _: _note_cancel(record, context))
        b = self.behaviour
        if b.reject_with is not None:
            await context.abort(b.reject_with, f"{self.node_id} refuses")
        params = request.sampling_params
        prompt = list(request.prompt_token_ids)
        seed = 0 if params.HasField("temperature") and params.temperature == 0 else params.seed
        max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
        first = node_pb2.TokenChunk(
            num_prompt_tokens=len(prompt),
            num_cached_tokens=self._cached_tokens(prompt),
            prefilled_by=f"remote:{request.prefill_candidates[0]}"
            if request.prefill_candidates
            else "local",
        )
        if params.HasField("prompt_logprobs"):
            first.prompt_logprobs.extend(
                fake_logprobs(prompt[i], i, params.prompt_logprobs) for i in range(1, len(prompt))
            )
        self._active += 1
        try:
            chunk, out = first, []
            while True:
                position = len(prompt) + len(out)
                token = script_token(b.script, position, seed)
                out.append(token)
                chunk.token_ids.append(token)
                if params.HasField("logprobs"):
                    chunk.logprobs.append(fake_logprobs(token, position, params.logprobs))
                chunk.finish_reason = _finish(token, out, params, max_tokens, position, b)
                if chunk.finish_reason or len(chunk.token_ids) >= b.tokens_per_chunk:
                    if b.token_delay_s:
                        await asyncio.sleep(b.token_delay_s)
                    yield chunk
                    record.num_tokens_sent = len(out)
                    if chunk.finish_reason:
                        record.finished = True
                        return
                    chunk = node_pb2.TokenChunk()
                    if b.die_after_tokens is not None and len(out) >= b.die_after_tokens:
                        await self._die()
                    if b.hang_after_tokens is not None and len(out) >= b.hang_after_tokens:
                        self.hung = True
                        await asyncio.sleep(60)
                    if b.stall_after_tokens is not None and len(out) >= b.stall_after_tokens:
                        await asyncio.sleep(60)
        except (asyncio.CancelledError, GeneratorExit):
            record.cancelled = True  # the gateway cancelled the call
            raise
        finally:
            self._active -= 1

    async def _die(self) -> None:
        """Stop the server from outside this call (stopping it from inside would wait for
        this very call), then wait to be cancelled with every other call."""
        assert self.server is not None
        asyncio.get_running_loop().create_task(self.server.stop(None))
        await asyncio.sleep(30)

    async def Abort(self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        self.aborted_ids.append(request.request_id)
        return node_pb2.AbortResponse()

    async def GetLoad(self, request: node_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        while self.hung:
            await asyncio.sleep(0.05)
        return node_pb2.NodeLoad(
            node_id=self.node_id,
            role="decode",
            model="fake",
            num_running=self._active + self.behaviour.extra_load,
            num_free_blocks=1000,
            num_total_blocks=1000,
            block_size=self.behaviour.block_size,
            max_model_len=self.behaviour.max_model_len,
            accepting=self.behaviour.accepting,
        )


def _note_cancel(record: CallRecord, context: grpc.aio.ServicerContext) -> None:
    if context.cancelled() and not record.finished:
        record.cancelled = True


def _finish(
    token: int,
    out: list[int],
    params: common_pb2.SamplingParams,
    max_tokens: int,
    position: int,
    b: DecodeBehaviour,
) -> int:
    if len(out) >= params.min_tokens:
        if token == EOS_TOKEN_ID and not params.ignore_eos:
            return common_pb2.FINISH_REASON_STOP
        if token in params.stop_token_ids:
            return common_pb2.FINISH_REASON_STOP
    if len(out) >= max_tokens or position + 1 >= b.max_model_len:
        return common_pb2.FINISH_REASON_LENGTH
    return common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class FakePrefillNode(node_pb2_grpc.PrefillNodeServicer):
    """PrefillNode servicer that only answers GetLoad (decode nodes call Prefill, not us)."""

    node_id: str = "prefill"
    block_size: int = 16
    num_running: int = 0
    accepting: bool = True

    async def GetLoad(self, request: node_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        return node_pb2.NodeLoad(
            node_id=self.node_id,
            role="prefill",
            model="fake",
            num_running=self.num_running,
            num_free_blocks=1000,
            num_total_blocks=1000,
            block_size=self.block_size,
            max_model_len=512,
            accepting=self.accepting,
        )


async def start_decode_node(node: FakeDecodeNode, port: int = 0) -> int:
    """Serve node on 127.0.0.1 (port 0: any free one); returns the port."""
    server = grpc.aio.server()
    node_pb2_grpc.add_DecodeNodeServicer_to_server(node, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    node.server = server
    return bound


async def start_prefill_node(node: FakePrefillNode) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    node_pb2_grpc.add_PrefillNodeServicer_to_server(node, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
