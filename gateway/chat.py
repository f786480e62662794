"""POST /v1/chat/completions: messages through the chat template to a GenerationRequest, and
deltas back to chat.completion objects or chat.completion.chunk streams."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pdserve.gateway.completions import final_usage, usage
from pdserve.gateway.context import GatewayContext
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.logprobs import chat_logprobs
from pdserve.gateway.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
)
from pdserve.gateway.prompts import chat_prompt_ids
from pdserve.gateway.sampling import (
    add_token_constraints,
    check_min_tokens,
    fit_max_tokens,
    to_sampling_params,
)
from pdserve.gateway.sequence import CompletionDelta, collect


def prepare_chat(ctx: GatewayContext, body: ChatCompletionRequest) -> GenerationRequest:
    """Check, template, tokenize and size a chat request (raises ApiError)."""
    ctx.check_model(body.model)
    max_model_len = ctx.check_decode_available()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = chat_prompt_ids(
        ctx.tokenizer,
        messages,
        body.add_generation_prompt,
        body.chat_template_kwargs,
        body.continue_final_message,
    )
    if body.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
    max_tokens = fit_max_tokens(body.max_output_tokens, len(prompt_ids), max_model_len, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = to_sampling_params(body, max_tokens, logprobs)
    add_token_constraints(params, body, ctx.tokenizer)
    check_min_tokens(params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    return ctx.new_request(
        request_id, prompt_ids, params, body.n, body.cache_salt or "", body.priority
    )


async def chat_response(
    ctx: GatewayContext,
    body: ChatCompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> ChatCompletionResponse:
    """The whole chat completion once every choice has finished."""
    outputs = await collect(deltas, request.n)
    choices = [
        ChatChoice(
            index=out.index,
            message=ChatResponseMessage(content=out.text),
            logprobs=ChatLogprobs(
                content=chat_logprobs(
                    out.logprobs, ctx.token_texts, body.return_tokens_as_token_ids
                )
            )
            if body.logprobs
            else None,
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            stop_reason=out.stop_reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        )
        for out in outputs
    ]
    return ChatCompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=body.model,
        choices=choices,
        usage=final_usage(request, outputs),
        prompt_token_ids=request.prompt_token_ids if body.return_token_ids else None,
    )


async def chat_stream(
    ctx: GatewayContext,
    body: ChatCompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> AsyncIterator[str]:
    """JSON of each chunk: first a role chunk per choice, then one per delta, then
    (include_usage) one with the usage and no choices."""
    created = int(time.time())
    exclude: set[str] = set() if body.include_usage else {"usage"}

    def chunk(choices: list[ChatChunkChoice], prompt_token_ids: list[int] | None = None) -> str:
        out = ChatCompletionChunk(
            id=request.request_id,
            created=created,
            model=body.model,
            choices=choices,
            prompt_token_ids=prompt_token_ids,
        )
        # vLLM's chunks have token_ids only with return_token_ids, prompt_token_ids only first.
        unset = {"prompt_token_ids"} if prompt_token_ids is None else set()
        choice_unset = {} if body.return_token_ids else {0: {"token_ids"}}
        return out.model_dump_json(
            exclude={**dict.fromkeys(exclude | unset, True), "choices": choice_unset}
        )

    for index in range(request.n):
        role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        first = body.return_token_ids and index == 0
        yield chunk([role], request.prompt_token_ids if first else None)
    num_output_tokens = [0] * request.n
    num_cached_tokens = 0
    async for delta in deltas:
        num_output_tokens[delta.index] = delta.num_output_tokens
        if delta.index == 0:
            num_cached_tokens = delta.num_cached_tokens
        logprobs = None
        if body.logprobs:
            logprobs = ChatLogprobs(
                content=chat_logprobs(
                    delta.logprobs, ctx.token_texts, body.return_tokens_as_token_ids
                )
            )
        choice = ChatChunkChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text),
            logprobs=logprobs,
            finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if body.return_token_ids else None,
        )
        yield chunk([choice])
    if body.include_usage:
        last = ChatCompletionChunk(
            id=request.request_id,
            created=created,
            model=body.model,
            choices=[],
            usage=usage(len(request.prompt_token_ids), num_cached_tokens, sum(num_output_tokens)),
        )
        yield last.model_dump_json()
