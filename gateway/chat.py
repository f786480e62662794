"""POST /v1/chat/completions: messages through the chat template to a GenerationRequest, and
deltas back to chat.completion objects or chat.completion.chunk streams."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.gateway.completions import final_usage, usage
from pdserve.gateway.context import GatewayContext
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation import GenerationRequest
from pdserve.gateway.logprobs import chat_logprobs, prompt_logprobs
from pdserve.gateway.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    fingerprint,
)
from pdserve.gateway.prompts import chat_prompt_ids
from pdserve.gateway.sampling import (
    add_token_constraints,
    check_min_tokens,
    fit_max_tokens,
    to_sampling_params,
)
from pdserve.gateway.sequence import CompletionDelta, collect
from pdserve.gateway.structured_outputs import add_structured_output, check, structured_output_of
from pdserve.gateway.tool_calls import (
    ToolOutput,
    check_tools,
    constraint,
    new_call_id,
    parse_output,
    resolve_tool_choice,
    template_messages,
)
from pdserve.v1 import common_pb2


def tool_choice_of(ctx: GatewayContext, body: ChatCompletionRequest) -> Any:
    """The request's effective tool_choice ("none" without tools; raises ApiError)."""
    functions = check_tools(body.tools)
    auto = ctx.config.enable_auto_tool_choice and ctx.config.tool_call_parser is not None
    return resolve_tool_choice(body.tool_choice, functions, auto)


def _split(ctx: GatewayContext, text: str, tool_choice: Any) -> ToolOutput:
    return parse_output(text, tool_choice, ctx.config.tool_call_parser)


def _finish_reason(reason: str | None, output: ToolOutput) -> str | None:
    return "tool_calls" if output.calls and reason == "stop" else reason


def prepare_chat(ctx: GatewayContext, body: ChatCompletionRequest) -> GenerationRequest:
    """Check, template, tokenize and size a chat request (raises ApiError)."""
    lora = ctx.check_model(body.model)
    max_model_len = ctx.check_decode_available()
    tool_choice = tool_choice_of(ctx, body)
    functions = check_tools(body.tools)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if functions:
        template_kwargs["tools"] = body.tools
    prompt_ids = chat_prompt_ids(
        ctx.tokenizer,
        template_messages(body.messages),
        body.add_generation_prompt,
        template_kwargs,
        body.continue_final_message,
    )
    if body.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
    max_tokens = fit_max_tokens(body.max_output_tokens, len(prompt_ids), max_model_len, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = to_sampling_params(body, max_tokens, logprobs, body.prompt_logprobs)
    add_token_constraints(params, body, ctx.tokenizer)
    spec = structured_output_of(body)
    tool_spec = constraint(tool_choice, functions, body.parallel_tool_calls)
    if tool_spec is not None:
        if spec is not None:
            raise ApiError.bad_request(
                "tool_choice required or a named function cannot be combined with another "
                "structured output constraint",
                "tool_choice",
            )
        check(tool_spec, "tools")  # a tool's parameters that are not a usable JSON schema
        spec = tool_spec
    if spec is not None:
        add_structured_output(params, spec)
    check_min_tokens(params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    return ctx.new_request(
        request_id, prompt_ids, params, body.n, body.cache_salt or "", body.priority, lora=lora
    )


async def chat_response(
    ctx: GatewayContext,
    body: ChatCompletionRequest,
    request: GenerationRequest,
    deltas: AsyncIterator[CompletionDelta],
) -> ChatCompletionResponse:
    """The whole chat completion once every choice has finished."""
    outputs = await collect(deltas, request.n)
    tool_choice = tool_choice_of(ctx, body)
    split = [_split(ctx, out.text, tool_choice) for out in outputs]
    choices = [
        ChatChoice(
            index=out.index,
            message=ChatResponseMessage(
                content=parts.content,
                tool_calls=[
                    ToolCall(
                        id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)
                    )
                    for c in parts.calls
                ],
            ),
            logprobs=ChatLogprobs(
                content=chat_logprobs(
                    out.logprobs, ctx.token_texts, body.return_tokens_as_token_ids
                )
            )
            if body.logprobs
            else None,
            finish_reason=_finish_reason(out.finish_reason, parts),  # type: ignore[arg-type]
            stop_reason=out.stop_reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        )
        for out, parts in zip(outputs, split, strict=True)
    ]
    prompt_entries = outputs[0].prompt_logprobs or []  # the n choices share one prompt
    return ChatCompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=body.model,
        system_fingerprint=fingerprint(outputs[0].model_version),
        choices=choices,
        usage=final_usage(request, outputs),
        prompt_token_ids=request.prompt_token_ids if body.return_token_ids else None,
        prompt_logprobs=prompt_logprobs(
            prompt_entries, ctx.token_texts, body.return_tokens_as_token_ids
        )
        if body.prompt_logprobs is not None
        else None,
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

    def chunk(
        choices: list[ChatChunkChoice],
        prompt_token_ids: list[int] | None = None,
        prompt_entries: list[common_pb2.TokenLogprob] | None = None,
        model_version: str = "",
    ) -> str:
        out = ChatCompletionChunk(
            id=request.request_id,
            created=created,
            model=body.model,
            system_fingerprint=fingerprint(model_version),
            choices=choices,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=None
            if prompt_entries is None
            else prompt_logprobs(prompt_entries, ctx.token_texts, body.return_tokens_as_token_ids),
        )
        # vLLM's chunks have token_ids only with return_token_ids, prompt_token_ids only first.
        unset = {"prompt_token_ids"} if prompt_token_ids is None else set()
        if prompt_entries is None:
            unset.add("prompt_logprobs")
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
    tool_choice = tool_choice_of(ctx, body)
    held = [""] * request.n  # with tools, a choice's text is parsed once it has finished
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
        message = DeltaMessage(content=delta.text)
        finish_reason = delta.finish_reason
        if tool_choice != "none":
            held[delta.index] += delta.text
            message = DeltaMessage(content=None)
            if finish_reason is not None:
                parts = _split(ctx, held[delta.index], tool_choice)
                message = _tool_delta(parts)
                finish_reason = _finish_reason(finish_reason, parts)
        choice = ChatChunkChoice(
            index=delta.index,
            delta=message,
            logprobs=logprobs,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if body.return_token_ids else None,
        )
        # prompt_logprobs (only 0 may be streamed): with index 0's first tokens
        wants_prompt = body.prompt_logprobs is not None and delta.index == 0
        prompt_entries = delta.prompt_logprobs if wants_prompt else None
        yield chunk([choice], None, prompt_entries, delta.model_version)
    if body.include_usage:
        last = ChatCompletionChunk(
            id=request.request_id,
            created=created,
            model=body.model,
            choices=[],
            usage=usage(len(request.prompt_token_ids), num_cached_tokens, sum(num_output_tokens)),
        )
        yield last.model_dump_json()


def _tool_delta(parts: ToolOutput) -> DeltaMessage:
    """A finished choice's content and calls as one delta (each call whole, with its id)."""
    calls = [
        DeltaToolCall(
            index=i,
            id=new_call_id(),
            type="function",
            function=FunctionCall(name=c.name, arguments=c.arguments),
        )
        for i, c in enumerate(parts.calls)
    ]
    return DeltaMessage(content=parts.content, tool_calls=calls or None)
