"""POST /v1/completions: the OpenAI request to a GenerationRequest, and deltas back to
OpenAI's text_completion objects (whole, or streamed as chunks).

A batched request (a list of prompts) is one GenerationRequest whose choices are numbered
prompt x n + sample, as OpenAI's. best_of > n generates best_of per prompt and returns the n
with the highest cumulative logprob (not streamable, as in OpenAI's API). echo puts the
prompt's text before each choice's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.gateway.context import GatewayContext
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs
from pdserve.gateway.openai_api import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    fingerprint,
)
from pdserve.gateway.prompts import completion_prompt_ids, split_prompts
from pdserve.gateway.sampling import (
    add_token_constraints,
    check_min_tokens,
    fit_max_tokens,
    to_sampling_params,
)
from pdserve.gateway.sequence import CompletionDelta, FinalOutput, collect
from pdserve.gateway.structured_outputs import add_structured_output, structured_output_of
from pdserve.v1 import common_pb2


def prepare_completion(ctx: GatewayContext, body: CompletionRequest) -> GenerationRequest:
    """Check, tokenize and size a completions request (raises ApiError)."""
    lora = ctx.check_model(body.model)
    max_model_len = ctx.check_decode_available()
    prompts = [
        completion_prompt_ids(ctx.tokenizer, prompt, body.truncate_prompt_tokens)
        for prompt in split_prompts(body.prompt)
    ]
    longest = max(prompts, key=len)
    max_tokens = fit_max_tokens(body.max_tokens, len(longest), max_model_len, "prompt")
    logprobs = body.logprobs
    if body.num_candidates > body.n and logprobs is None:
        logprobs = 0  # best_of ranks candidates by their cumulative logprob
    params = to_sampling_params(body, max_tokens, logprobs, body.num_prompt_logprobs)
    add_token_constraints(params, body, ctx.tokenizer)
    spec = structured_output_of(body)
    if spec is not None:
        add_structured_output(params, spec)
    check_min_tokens(params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    batch = tuple(prompts) if len(prompts) > 1 else ()
    return ctx.new_request(
        request_id,
        prompts[0],
        params,
        body.num_candidates,
        body.cache_salt or "",
        body.priority,
        batch,
        lora,
    )


def usage(num_prompt_tokens: int, num_cached_tokens: int, completion_tokens: int) -> UsageInfo:
    """OpenAI's usage; the prompt counts once however many completions share it."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def num_prompt_tokens(request: GenerationRequest) -> int:
    """Every prompt of the request, each counted once."""
    return sum(len(prompt) for prompt in request.prompts)


def final_usage(request: GenerationRequest, outputs: list[FinalOutput]) -> UsageInfo:
    """The usage of a request whose completions are all done (cached tokens: each prompt's
    first completion's)."""
    return usage(
        num_prompt_tokens(request),
        sum(out.num_cached_tokens for out in outputs if out.index % request.n == 0),
        sum(len(out.token_ids) for out in outputs),
    )


def _best(outputs: list[FinalOutput], num_candidates: int, n: int) -> list[FinalOutput]:
    """Per prompt, the n of its num_candidates outputs with the highest cumulative logprob
    (ties: the lower index), renumbered prompt x n + rank."""
    chosen = []
    for start in range(0, len(outputs), num_candidates):
        group = outputs[start : start + num_candidates]
        group.sort(key=lambda out: -sum(lp.logprob for lp in out.logprobs))
        chosen.extend(group[:n])
    for index, out in enumerate(chosen):
        out.index = index
    return chosen


class _Echo:
    """The prompts' texts, for echo: the text given, or the token ids decoded."""

    def __init__(self, ctx: GatewayContext, body: CompletionRequest, request: GenerationRequest):
        texts = split_prompts(body.prompt)
        self._texts = [
            text if isinstance(text, str) else ctx.tokenizer.decode(prompt)
            for text, prompt in zip(texts, request.prompts, strict=True)
        ]
        self._n = body.n

    def text(self, index: int) -> str:
        return self._texts[index // self._n]


async def completion_response(
    ctx: GatewayContext,
    body: CompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> CompletionResponse:
    """The whole completion once every choice has finished."""
    outputs = await collect(deltas, request.num_choices)
    response_usage = final_usage(request, outputs)
    if body.num_candidates > body.n:
        outputs = _best(outputs, body.num_candidates, body.n)
    echo = _Echo(ctx, body, request) if body.echo else None
    choices = [
        CompletionChoice(
            index=out.index,
            text=(echo.text(out.index) if echo else "") + out.text,
            logprobs=_logprobs(ctx, body, request, out.index, out.prompt_logprobs, out.logprobs),
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            stop_reason=out.stop_reason,
            prompt_token_ids=request.prompt_of(out.index) if body.return_token_ids else None,
            token_ids=out.token_ids if body.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(
                out.prompt_logprobs or [], ctx.token_texts, body.return_tokens_as_token_ids
            )
            if body.prompt_logprobs is not None
            else None,
        )
        for out in outputs
    ]
    return CompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=body.model,
        system_fingerprint=fingerprint(outputs[0].model_version),
        choices=choices,
        usage=response_usage,
    )


def _logprobs(
    ctx: GatewayContext,
    body: CompletionRequest,
    request: GenerationRequest,
    index: int,
    prompt_entries: list[common_pb2.TokenLogprob] | None,
    entries: list[common_pb2.TokenLogprob],
    text_offset: int = 0,
) -> CompletionLogprobs | None:
    """A choice's logprobs (None unless asked); prompt_entries, the prompt's logprobs, are
    given (not None) where the choice echoes its prompt: they come first."""
    if body.logprobs is None:
        return None
    as_ids = body.return_tokens_as_token_ids
    if body.echo and prompt_entries is not None:
        prompt = request.prompts[index // body.n]
        return echo_logprobs(prompt, prompt_entries, entries, ctx.token_texts, as_ids)
    return completion_logprobs(entries, ctx.token_texts, text_offset, as_ids)


def _chunk_exclusions(exclude: set[str], choice: CompletionChoice) -> dict[str, Any]:
    """What a chunk leaves out: usage unless asked for, and the token-id fields it has not
    set (vLLM's chunks have them only with return_token_ids, prompt_token_ids only first)."""
    unset = {
        name: True
        for name in ("prompt_token_ids", "token_ids", "prompt_logprobs")
        if getattr(choice, name) is None
    }
    return {**{key: True for key in exclude}, "choices": {0: unset}}


async def completion_stream(
    ctx: GatewayContext,
    body: CompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> AsyncIterator[str]:
    """JSON of each chunk: one per delta, then (include_usage) one with the usage and no
    choices. Without include_usage the chunks have no usage key, as OpenAI's. A choice's first
    chunk carries its echo and (return_token_ids) its prompt's token ids."""
    created = int(time.time())
    exclude: set[str] = set() if body.include_usage else {"usage"}
    num_choices = request.num_choices
    text_offsets = [0] * num_choices
    num_output_tokens = [0] * num_choices
    num_cached_tokens = [0] * num_choices
    started = [False] * num_choices
    echo = _Echo(ctx, body, request) if body.echo else None
    async for delta in deltas:
        index = delta.index
        first = not started[index]
        started[index] = True
        prompt_entries = (delta.prompt_logprobs or []) if first and body.echo else None
        logprobs = _logprobs(
            ctx, body, request, index, prompt_entries, delta.logprobs, text_offsets[index]
        )
        if logprobs is not None and logprobs.tokens:  # the next token's offset
            last = (
                delta.logprobs[-1].token_id
                if delta.logprobs
                else request.prompts[index // body.n][-1]
            )  # an echoed prompt alone
            text_offsets[index] = logprobs.text_offset[-1] + len(ctx.token_texts.text(last))
        num_output_tokens[index] = delta.num_output_tokens
        num_cached_tokens[index] = delta.num_cached_tokens
        choice = CompletionChoice(
            index=index,
            text=(echo.text(index) if echo and first else "") + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            stop_reason=delta.stop_reason,
            prompt_token_ids=request.prompt_of(index) if body.return_token_ids and first else None,
            token_ids=delta.token_ids if body.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(
                delta.prompt_logprobs or [], ctx.token_texts, body.return_tokens_as_token_ids
            )
            if body.prompt_logprobs is not None and first
            else None,
        )
        chunk = CompletionResponse(
            id=request.request_id,
            created=created,
            model=body.model,
            system_fingerprint=fingerprint(delta.model_version),
            choices=[choice],
        )
        yield chunk.model_dump_json(exclude=_chunk_exclusions(exclude, choice))
    if body.include_usage:
        cached = sum(c for i, c in enumerate(num_cached_tokens) if i % request.n == 0)
        last = CompletionResponse(
            id=request.request_id,
            created=created,
            model=body.model,
            choices=[],
            usage=usage(num_prompt_tokens(request), cached, sum(num_output_tokens)),
        )
        yield last.model_dump_json()
