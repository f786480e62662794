"""Prompts to token ids: completions prompts (text or ids) and chat messages (templated)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import ApiError


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """token_ids as a list, or a 400 when empty or outside the vocabulary."""
    if not token_ids:
        raise ApiError.bad_request("the prompt is empty", param)
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise ApiError.bad_request(
                f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size})", param
            )
    return list(token_ids)


MAX_BATCHED_PROMPTS = 64
"""Most prompts one /v1/completions request may batch."""


def split_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[str] | list[list[int]]:
    """A completions prompt as a list of prompts: a string or token ids is one; a list of
    strings or of token-id lists is a batch."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str | list):
        if len(prompt) > MAX_BATCHED_PROMPTS:
            raise ApiError.bad_request(
                f"at most {MAX_BATCHED_PROMPTS} prompts may be batched in one request", "prompt"
            )
        return prompt  # type: ignore[return-value]
    return [prompt]  # type: ignore[list-item]


def completion_prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[int], truncate_to: int | None = None
) -> list[int]:
    """One completions prompt (text or token ids) as token ids, its last truncate_to tokens
    when set (vLLM's truncate_prompt_tokens). Text gets the tokenizer's special tokens (bos),
    like the offline engine."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if truncate_to is not None:
        ids = ids[-truncate_to:]
    return check_token_ids(ids, tokenizer.vocab_size, "prompt")


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """Messages through the model's chat template. continue_final_message leaves the last
    (assistant) message open: the text ends where its content ends, as vLLM (and
    transformers) cut it, so the model continues it."""
    if tokenizer.chat_template is None:
        raise ApiError.bad_request("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )
    except jinja2.TemplateError as exc:
        raise ApiError.bad_request(f"the chat template failed: {exc}", "messages") from exc
    if continue_final_message:
        final = messages[-1]["content"].strip()
        end = text.rfind(final) if final else -1
        if end == -1:
            raise ApiError.bad_request(
                "continue_final_message: the chat template does not write the final message's "
                "content verbatim",
                "messages",
            )
        text = text[: end + len(final)]
    return text


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Render messages (render_chat) and tokenize the result (without adding special tokens:
    the template writes them)."""
    text = render_chat(
        tokenizer, messages, add_generation_prompt, template_kwargs, continue_final_message
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return check_token_ids(ids, tokenizer.vocab_size, "messages")
