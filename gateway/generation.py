"""GenerationPipeline: the request path from token ids to completion deltas.

A request fans out into n child sequences per prompt (a batched completions request has
several prompts; child index = prompt index x n + sample index, as OpenAI numbers choices). Each child is routed to a decode node and streamed
from its Generate call through a SequenceOutput (detokenizer + stop strings). A node that
refuses the request (full, draining, gone) before any token is replaced by another; a node that
fails mid-stream is replaced too, with the prompt plus the tokens generated so far and
max_tokens reduced to match, so a seeded sequence continues exactly as it would have. Every
call carries the request's deadline, and leaving early (stop string, client gone, error)
cancels the calls still open, which aborts the requests on their nodes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from pdserve.common import tracing
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import ApiError
from pdserve.gateway.metrics import GatewayMetrics, SequenceTimer
from pdserve.gateway.registry import NodeRegistry, NodeState
from pdserve.gateway.router import Router
from pdserve.gateway.sequence import CompletionDelta, SequenceOutput
from pdserve.v1 import common_pb2, node_pb2

logger = logging.getLogger(__name__)

_INT64_SPAN = 1 << 64
_INT64_MAX = (1 << 63) - 1
_REMOTE_PREFILL = "remote:"
"""TokenChunk.prefilled_by prefix naming the prefill node that did the work."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request, ready for the decode tier."""

    request_id: str
    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams
    """Validated; max_tokens always set. Child i of a seeded request uses seed + i."""
    deadline: float
    """time.monotonic() by which the last token must have arrived."""
    n: int = 1
    cache_salt: str = ""
    priority: int = 0
    arrival_s: float = field(default_factory=time.monotonic)
    """time.monotonic() when the client's request arrived (latencies count from here)."""
    trace_context: Context | None = None
    """The request's root span at the gateway (None when tracing is off)."""
    batch: tuple[list[int], ...] = ()
    """Every prompt of a batched /v1/completions request (prompt_token_ids is batch[0]); empty
    for one prompt."""
    lora: common_pb2.LoRAAdapter | None = None
    """The LoRA adapter the request names as its model (None: the base model)."""

    @property
    def prompts(self) -> tuple[list[int], ...]:
        """The request's prompts, in order."""
        return self.batch or (self.prompt_token_ids,)

    @property
    def num_choices(self) -> int:
        """Child sequences: n per prompt."""
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> list[int]:
        """The prompt of child `index`."""
        return self.prompts[index // self.n]


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The decode request id of completion `index`: the request's own id when n == 1."""
    return request_id if n == 1 else f"{request_id}-{index}"


def child_seed(seed: int, index: int) -> int:
    """seed + index, wrapped into int64 (as the engine reduces seeds)."""
    return (seed + index + (1 << 63)) % _INT64_SPAN - (1 << 63)


class _NodeFailed(Exception):
    """A decode node could not finish a child; another node may."""


_STALL_CHECK_S = 0.25
"""How often a stream waiting for its next chunk looks at its node's health and the clock."""
_UNHEALTHY_GRACE_S = 1.0
"""A stream on a node the registry marked unhealthy moves after this long without a chunk."""
_STALL_GAPS = 20
"""A stream moves after this many of its recent inter-chunk gaps without a chunk (if longer
than the stall timeout)."""


class _StallWatch:
    """Reads a Generate call's chunks with progress deadlines: a node that stops producing
    (hung, SIGSTOPped, its engine stuck) costs its streams seconds, not the whole hang. A
    stream moves (_NodeFailed) when its node turns unhealthy (polls fail: ~1 s for a stopped
    process) and no chunk came for _UNHEALTHY_GRACE_S, or, once tokens flow, when none came
    for max(stall_timeout_s, _STALL_GAPS x the recent gap). Before the first chunk (prefill,
    queueing) only the first rule applies: how long a prompt takes is not known here.

    Each chunk is read straight from the call; one timer a stream looks at the clock every
    _STALL_CHECK_S and, when a rule fires while the stream waits, cancels the wait. (A task
    and a timed asyncio.wait per chunk cost ~a fifth of the gateway's CPU per streamed token.)
    Call close() when the stream is over."""

    def __init__(self, node: NodeState, stall_timeout_s: float) -> None:
        self._node = node
        self._stall_timeout_s = stall_timeout_s
        self._last_s = time.monotonic()
        self._gap_s: float | None = None
        """Exponential average of the gaps between chunks (None before the second chunk)."""
        self._chunks = 0
        self._reader: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = False
        self._failure: _NodeFailed | None = None
        """Set by the timer just before it cancels the waiting read."""

    async def next_chunk(self, call: Any) -> node_pb2.TokenChunk | None:
        """The next chunk, None at the end of the stream; raises the call's error, or
        _NodeFailed past a deadline."""
        if self._reader is None:
            self._reader = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(_STALL_CHECK_S, self._tick)
        self._waiting = True
        try:
            chunk = await call.read()
        except asyncio.CancelledError:
            failure, self._failure = self._failure, None
            # Ours alone: the deadline's failure. Cancelled from outside too: cancelled.
            if failure is None or self._reader is None or self._reader.uncancel() > 0:
                raise
            raise failure from None
        finally:
            self._waiting = False
        self._note()
        return None if chunk is grpc.aio.EOF else chunk

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(_STALL_CHECK_S, self._tick)
        if not self._waiting or self._failure is not None or self._reader is None:
            return
        try:
            self._check(time.monotonic() - self._last_s)
        except _NodeFailed as exc:
            self._failure = exc
            self._reader.cancel()  # the reader waits in call.read(): it gets the failure there

    def _note(self) -> None:
        now = time.monotonic()
        if self._chunks >= 1:
            gap = now - self._last_s
            self._gap_s = gap if self._gap_s is None else 0.8 * self._gap_s + 0.2 * gap
        self._chunks += 1
        self._last_s = now

    def _check(self, waited_s: float) -> None:
        if not self._node.healthy and waited_s >= _UNHEALTHY_GRACE_S:
            raise _NodeFailed(f"no token for {waited_s:.1f}s from an unhealthy node")
        if self._chunks and waited_s >= self._deadline_s():
            raise _NodeFailed(f"stalled: no token for {waited_s:.1f}s")

    def _deadline_s(self) -> float:
        gap = self._gap_s or 0.0
        return max(self._stall_timeout_s, _STALL_GAPS * gap)


class GenerationPipeline:
    """Runs GenerationRequests on the decode nodes of a registry (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        registry: NodeRegistry,
        router: Router,
        metrics: GatewayMetrics,
        rng: random.Random | None = None,
        stall_timeout_s: float = 5.0,
    ) -> None:
        self._stall_timeout_s = stall_timeout_s
        self._tokenizer = tokenizer
        self._registry = registry
        self._router = router
        self._metrics = metrics
        self._rng = rng or random.Random()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[CompletionDelta]:
        """Deltas of all n completions, interleaved as they arrive; each completion's last
        delta has finish_reason set. Raises ApiError; closing the iterator cancels every
        child's decode call."""
        queue: asyncio.Queue[CompletionDelta | ApiError] = asyncio.Queue()
        # One version of the weights for all n completions (a rolling update may be under way):
        # that of the node the first pick finds.
        first = self._router.pick_decode()
        version = first.load.model_version if first is not None and first.load else ""
        tasks = [
            asyncio.create_task(self._run_child(request, i, queue.put_nowait, version or None))
            for i in range(request.num_choices)
        ]
        try:
            unfinished = request.num_choices
            while unfinished:
                item = await queue.get()
                if isinstance(item, ApiError):
                    raise item
                if item.finish_reason is not None:
                    unfinished -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _child_params(self, request: GenerationRequest, index: int) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams()
        params.CopyFrom(request.params)
        if not params.HasField("seed"):
            # A gateway-drawn seed makes a resubmitted sequence continue exactly.
            params.seed = self._rng.randint(0, _INT64_MAX)
        elif request.n > 1:
            # As engine.llm fans out n; every prompt of a batch uses the same seeds.
            params.seed = child_seed(params.seed, index % request.n)
        return params

    async def _run_child(
        self,
        request: GenerationRequest,
        index: int,
        emit: Callable[[CompletionDelta | ApiError], None],
        model_version: str | None = None,
    ) -> None:
        timer = self._metrics.sequence(request.arrival_s, len(request.prompt_of(index)))
        child_id = child_request_id(request.request_id, index, request.num_choices)
        attributes = {"pdserve.request_id": child_id, "pdserve.index": index}
        span = tracing.start_span(
            "gateway.completion", request.trace_context, attributes=attributes
        )
        try:
            reason = await self._drive_child(request, index, emit, timer, span, model_version)
        except ApiError as exc:
            self._end_child(timer, span, "error", exc)
            emit(exc)
        except asyncio.CancelledError as exc:  # the client left, or a sibling failed
            self._end_child(timer, span, "abort", exc)
            raise
        except Exception as exc:  # a bug must fail the request, not hang it
            logger.exception("request %s completion %d failed", request.request_id, index)
            self._end_child(timer, span, "error", exc)
            emit(ApiError.internal(f"request {request.request_id} failed: {exc!r}"))
        else:
            self._end_child(timer, span, reason)

    @staticmethod
    def _end_child(
        timer: SequenceTimer,
        span: Span,
        finished_reason: str,
        error: BaseException | None = None,
    ) -> None:
        timer.finish(finished_reason)
        if span.is_recording():
            span.set_attributes(
                {
                    "pdserve.finished_reason": finished_reason,
                    "pdserve.prompt_tokens": timer.num_prompt_tokens,
                    "pdserve.generated_tokens": timer.num_tokens,
                    "pdserve.decode_node": timer.node,
                }
            )
        tracing.end_span(span, error)

    async def _drive_child(
        self,
        request: GenerationRequest,
        index: int,
        emit: Callable[[CompletionDelta | ApiError], None],
        timer: SequenceTimer,
        span: Span,
        model_version: str | None = None,
    ) -> str:
        """Run one completion to its end, on as many decode nodes as it takes (of
        model_version, when given, and always of the version that produced its first tokens);
        returns its finish reason."""
        params = self._child_params(request, index)
        seq = SequenceOutput(index, self._tokenizer, request.prompt_of(index), params)
        child_id = child_request_id(request.request_id, index, request.num_choices)
        parent = tracing.context_of(span)
        failures: dict[str, str] = {}
        while True:
            if len(seq.output_token_ids) >= params.max_tokens:
                # The node died after the last token but before sending its finish.
                emit(seq.finish_delta("length"))
                return "length"
            route = tracing.start_span("gateway.route", parent)
            version = seq.model_version or model_version
            node = self._router.pick_decode(exclude=failures.keys(), model_version=version)
            if node is None:
                error = _no_node_error(child_id, seq, failures)
                tracing.end_span(route, error)
                raise error
            decode_request, release_prefill = self._decode_request(
                request, child_id, len(failures), params, seq, node
            )
            _describe_route(route, node, decode_request)
            tracing.end_span(route)
            try:
                await self._stream(
                    node,
                    decode_request,
                    request.deadline,
                    seq,
                    emit,
                    timer,
                    parent,
                    release_prefill,
                )
                if seq.model_version:
                    self._metrics.produced_by(seq.model_version)
                return seq.finish_reason or "stop"
            except _NodeFailed as exc:
                failures[node.address] = str(exc)
                logger.warning(
                    "decode node %s failed %s after %d tokens: %s",
                    node.address,
                    child_id,
                    len(seq.output_token_ids),
                    exc,
                )

    def _decode_request(
        self,
        request: GenerationRequest,
        child_id: str,
        attempt: int,
        params: common_pb2.SamplingParams,
        seq: SequenceOutput,
        node: NodeState,
    ) -> tuple[node_pb2.DecodeRequest, Callable[[], None]]:
        """The DecodeRequest for an attempt (a resubmission's prompt holds the tokens already
        generated, and its token limits shrink by as many), and the release of the prompt's
        place in its first prefill candidate's queue (Router.reserve_prefill). Its prefill
        candidates serve the same weights as node, the decode node it goes to."""
        prompt = seq.prompt_token_ids + seq.output_token_ids
        attempt_params = common_pb2.SamplingParams()
        attempt_params.CopyFrom(params)
        num_done = len(seq.output_token_ids)
        attempt_params.max_tokens = params.max_tokens - num_done
        attempt_params.min_tokens = max(params.min_tokens - num_done, 0)
        if seq.prompt_logprobs is not None:  # already reported (the new prompt is longer)
            attempt_params.ClearField("prompt_logprobs")
        if params.HasField("structured_output"):  # the new node's matcher replays them first
            attempt_params.structured_output.num_generated_in_prompt = num_done
        version = node.load.model_version if node.load is not None else None
        candidates = self._router.rank_prefill(prompt, request.cache_salt, version or None)
        release: Callable[[], None] = _nothing
        if candidates:
            # Counted and recorded now, not when the node reports it, so that the next
            # requests of a burst see this one in the node's queue, and the n children of one
            # request (and bursts sharing a prefix) follow each other.
            release = self._router.reserve_prefill(candidates[0], len(prompt))
            self._router.record_prefill(candidates[0].node.address, prompt, request.cache_salt)
        decode_request = node_pb2.DecodeRequest(
            # A fresh id per attempt: the failed node may still hold the old one.
            request_id=child_id if attempt == 0 else f"{child_id}-retry{attempt}",
            prompt_token_ids=prompt,
            sampling_params=attempt_params,
            prefill_candidates=[c.node.address for c in candidates],
            cache_salt=request.cache_salt,
            priority=request.priority,
        )
        if request.lora is not None:
            decode_request.lora.CopyFrom(request.lora)
        return decode_request, release

    async def _stream(
        self,
        node: NodeState,
        decode_request: node_pb2.DecodeRequest,
        deadline: float,
        seq: SequenceOutput,
        emit: Callable[[CompletionDelta | ApiError], None],
        timer: SequenceTimer,
        parent: Context | None,
        release_prefill: Callable[[], None],
    ) -> None:
        """Stream one Generate call into seq until the sequence finishes; raises _NodeFailed
        when another node should take over. release_prefill is called once the prompt is
        prefilled (the first chunk) or the call is over."""
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            raise ApiError.timeout(f"request {decode_request.request_id} ran out of time")
        attributes = {
            "pdserve.request_id": decode_request.request_id,
            "pdserve.decode_node": node.address,
            "rpc.system": "grpc",
            "rpc.method": "pdserve.v1.DecodeNode/Generate",
        }
        span = tracing.start_span("gateway.decode", parent, SpanKind.CLIENT, attributes)
        metadata = tracing.grpc_metadata(tracing.context_of(span))
        call = node.decode_stub.Generate(decode_request, timeout=timeout_s, metadata=metadata)
        node.num_inflight += 1
        error: BaseException | None = None
        watch = _StallWatch(node, self._stall_timeout_s)
        try:
            while (chunk := await watch.next_chunk(call)) is not None:
                release_prefill()
                if chunk.token_ids:
                    timer.on_tokens(len(chunk.token_ids), node.address)
                if chunk.prefilled_by.startswith(_REMOTE_PREFILL):
                    # The node may have passed over the top candidate.
                    address = chunk.prefilled_by.removeprefix(_REMOTE_PREFILL)
                    prompt = decode_request.prompt_token_ids
                    self._router.record_prefill(address, prompt, decode_request.cache_salt)
                delta = seq.add_chunk(chunk)
                if delta.text or delta.token_ids or seq.finished:
                    emit(delta)
                if seq.finished:
                    return
                if chunk.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    raise _NodeFailed("the node aborted the request")
            raise _NodeFailed("the stream ended without a finish reason")
        except grpc.aio.AioRpcError as exc:
            error = self._call_failure(node, exc, seq)
            raise error from exc
        except BaseException as exc:  # _NodeFailed, cancelled: recorded, then re-raised
            error = exc
            raise
        finally:
            watch.close()
            release_prefill()
            node.num_inflight -= 1
            call.cancel()  # no-op when the call is over; aborts the node's request otherwise
            if span.is_recording():
                span.set_attribute("pdserve.generated_tokens", len(seq.output_token_ids))
            tracing.end_span(span, error)

    def _call_failure(
        self, node: NodeState, exc: grpc.aio.AioRpcError, seq: SequenceOutput
    ) -> Exception:
        """What a failed Generate call means: the client's fault, the deadline, or a node
        failure that another node may make good."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT and not seq.output_token_ids:
            return ApiError.bad_request(f"the decode node rejected the request: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ApiError.timeout("the request did not finish within the request timeout")
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # full or draining: the node is fine
            self._registry.mark_failed(node, f"Generate failed: {code.name} {details}")
        return _NodeFailed(f"{code.name}: {details}")


def _describe_route(span: Span, node: NodeState, decode_request: node_pb2.DecodeRequest) -> None:
    if span.is_recording():
        span.set_attributes(
            {
                "pdserve.decode_node": node.address,
                "pdserve.prefill_candidates": list(decode_request.prefill_candidates),
                "pdserve.prompt_tokens": len(decode_request.prompt_token_ids),
            }
        )


def _no_node_error(child_id: str, seq: SequenceOutput, failures: dict[str, str]) -> ApiError:
    if not failures:
        return ApiError.unavailable("no healthy decode node is available")
    reasons = "; ".join(f"{address}: {why}" for address, why in failures.items())
    if seq.output_token_ids:
        return ApiError.internal(
            f"decode failed mid-stream for {child_id} after {len(seq.output_token_ids)} tokens "
            f"and no other decode node could take over ({reasons})"
        )
    return ApiError.unavailable(f"no decode node could take the request ({reasons})")


def _nothing() -> None:
    """release() of a request offered no prefill node."""
