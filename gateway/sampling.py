"""Sampling parameters: from an OpenAI request to the wire's SamplingParams, range checks for
the gRPC front, and the max_tokens that fits max_model_len."""

from __future__ import annotations

import math
from collections.abc import Callable

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import ApiError
from pdserve.gateway.openai_api import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    SamplingRequest,
)
from pdserve.gateway.structured_outputs import check_wire_structured_output
from pdserve.v1 import common_pb2

_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)

# Field -> (allowed, what the message says); checked only when the field is set.
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, ">= -1"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "> 0"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "max_tokens": (lambda v: v >= 1, ">= 1"),
    "logprobs": (lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    "prompt_logprobs": (lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
}


def to_sampling_params(
    request: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> common_pb2.SamplingParams:
    """The wire parameters of a validated OpenAI request (unset fields stay unset, so the
    engine's defaults apply)."""
    params = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop_token_ids=request.stop_token_ids or [],
        stop=request.stop_strings,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        allowed_token_ids=request.allowed_token_ids or [],
    )
    for token, bias in (request.logit_bias or {}).items():
        params.logit_bias[int(token)] = bias
    for name in _OPTIONAL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            setattr(params, name, value)
    if logprobs is not None:
        params.logprobs = logprobs
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    return params


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as vLLM forms them: the word as written (leading spaces
    stripped), and also with one leading space where that tokenizes to a different first token
    but as many tokens (a word mid-sentence)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def add_token_constraints(
    params: common_pb2.SamplingParams, request: SamplingRequest, tokenizer: Tokenizer
) -> None:
    """Tokenize the request's bad words into params, and check every token id that
    logit_bias, allowed_token_ids and bad words name against the vocabulary (a 400)."""
    for ids in bad_words_token_ids(tokenizer, request.bad_words or []):
        params.bad_words.add(token_ids=ids)
    check_token_constraints(params, tokenizer.vocab_size)


def check_token_constraints(params: common_pb2.SamplingParams, vocab_size: int) -> None:
    """A 400 naming the first field whose token ids fall outside [0, vocab_size), or whose
    values are out of range (REST requests were range-checked when parsed; gRPC ones not)."""
    named = {
        "logit_bias": list(params.logit_bias),
        "allowed_token_ids": list(params.allowed_token_ids),
        "bad_words": [t for word in params.bad_words for t in word.token_ids],
    }
    for name, ids in named.items():
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError.bad_request(
                f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", name
            )
    for token, bias in params.logit_bias.items():
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ApiError.bad_request(
                f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                f"got {bias} for token {token}",
                "logit_bias",
            )
    if any(not word.token_ids for word in params.bad_words):
        raise ApiError.bad_request("bad_words must not hold an empty sequence", "bad_words")


def check_sampling_params(params: common_pb2.SamplingParams) -> None:
    """Raise a 400 naming the first field out of range (requests from the gRPC front; REST
    requests were checked field by field when parsed)."""
    for name, (allowed, expected) in _RANGES.items():
        if not params.HasField(name):
            continue
        if not math.isfinite(getattr(params, name)):
            raise ApiError.bad_request(f"{name} must be a finite number", name)
        if not allowed(getattr(params, name)):
            raise ApiError.bad_request(
                f"{name} must be {expected}, got {getattr(params, name)}", name
            )
    if params.min_tokens < 0:
        raise ApiError.bad_request(
            f"min_tokens must be >= 0, got {params.min_tokens}", "min_tokens"
        )
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ApiError.bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(t < 0 for t in params.stop_token_ids):
        raise ApiError.bad_request("stop_token_ids must be >= 0", "stop_token_ids")
    check_wire_structured_output(params)


def fit_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, prompt_param: str
) -> int:
    """requested, checked against max_model_len; None means all the room the prompt leaves."""
    room = max_model_len - num_prompt_tokens
    max_tokens = room if requested is None else requested
    if max_tokens < 1 or num_prompt_tokens + max_tokens > max_model_len:
        raise ApiError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max(max_tokens, 1)} tokens ({num_prompt_tokens} in "
            f"the {prompt_param}, {max(max_tokens, 1)} in the completion). Please reduce the "
            f"length of the {prompt_param} or completion.",
            prompt_param,
        )
    return max_tokens


def check_min_tokens(params: common_pb2.SamplingParams) -> None:
    if params.min_tokens > params.max_tokens:
        raise ApiError.bad_request(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
            "min_tokens",
        )
