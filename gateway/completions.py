"""POST /v1/completions: the OpenAI request to a GenerationRequest, and deltas back to
OpenAI's text_completion objects (whole, or streamed as chunks)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pdserve.gateway.context import GatewayContext
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.logprobs import completion_logprobs
from pdserve.gateway.openai_api import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pdserve.gateway.prompts import completion_prompt_ids
from pdserve.gateway.sampling import check_min_tokens, fit_max_tokens, to_sampling_params
from pdserve.gateway.sequence import CompletionDelta, FinalOutput, collect


def prepare_completion(ctx: GatewayContext, body: CompletionRequest) -> GenerationRequest:
    """Check, tokenize and size a completions request (raises ApiError)."""
    ctx.check_model(body.model)
    max_model_len = ctx.check_decode_available()
    prompt_ids = completion_prompt_ids(ctx.tokenizer, body.prompt)
    max_tokens = fit_max_tokens(body.max_tokens, len(prompt_ids), max_model_len, "prompt")
    params = to_sampling_params(body, max_tokens, body.logprobs)
    check_min_tokens(params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return ctx.new_request(
        request_id, prompt_ids, params, body.n, body.cache_salt or "", body.priority
    )


def usage(num_prompt_tokens: int, num_cached_tokens: int, completion_tokens: int) -> UsageInfo:
    """OpenAI's usage; the prompt counts once however many completions share it."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def final_usage(request: GenerationRequest, outputs: list[FinalOutput]) -> UsageInfo:
    """The usage of a request whose n completions are all done."""
    return usage(
        len(request.prompt_token_ids),
        outputs[0].num_cached_tokens,
        sum(len(out.token_ids) for out in outputs),
    )


async def completion_response(
    ctx: GatewayContext,
    body: CompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> CompletionResponse:
    """The whole completion once every choice has finished."""
    outputs = await collect(deltas, request.n)
    choices = [
        CompletionChoice(
            index=out.index,
            text=out.text,
            logprobs=completion_logprobs(out.logprobs, ctx.token_texts, 0)
            if body.logprobs is not None
            else None,
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            stop_reason=out.stop_reason,
        )
        for out in outputs
    ]
    return CompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=body.model,
        choices=choices,
        usage=final_usage(request, outputs),
    )


async def completion_stream(
    ctx: GatewayContext,
    body: CompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> AsyncIterator[str]:
    """JSON of each chunk: one per delta, then (include_usage) one with the usage and no
    choices. Without include_usage the chunks have no usage key, as OpenAI's."""
    created = int(time.time())
    exclude = None if body.include_usage else {"usage"}
    text_offsets = [0] * request.n
    num_output_tokens = [0] * request.n
    num_cached_tokens = 0
    async for delta in deltas:
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(
                delta.logprobs, ctx.token_texts, text_offsets[delta.index]
            )
            text_offsets[delta.index] += sum(len(t) for t in logprobs.tokens)
        num_output_tokens[delta.index] = delta.num_output_tokens
        if delta.index == 0:
            num_cached_tokens = delta.num_cached_tokens
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            stop_reason=delta.stop_reason,
        )
        chunk = CompletionResponse(
            id=request.request_id, created=created, model=body.model, choices=[choice]
        )
        yield chunk.model_dump_json(exclude=exclude)
    if body.include_usage:
        last = CompletionResponse(
            id=request.request_id,
            created=created,
            model=body.model,
            choices=[],
            usage=usage(len(request.prompt_token_ids), num_cached_tokens, sum(num_output_tokens)),
        )
        yield last.model_dump_json()
