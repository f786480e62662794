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


def completion_prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[int]:
    """A completions prompt: a string, a list of one string, token ids, or a list of one
    token-id list. Text gets the tokenizer's special tokens (bos), like the offline engine."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError.bad_request(
                "batched prompts are not supported: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return check_token_ids(tokenizer.encode(prompt), tokenizer.vocab_size, "prompt")
    return check_token_ids(prompt, tokenizer.vocab_size, "prompt")


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render messages with the model's chat template and tokenize the result (without adding
    special tokens: the template writes them)."""
    if tokenizer.chat_template is None:
        raise ApiError.bad_request("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
        )
    except jinja2.TemplateError as exc:
        raise ApiError.bad_request(f"the chat template failed: {exc}", "messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    return check_token_ids(ids, tokenizer.vocab_size, "messages")
