"""The OpenAI REST shapes: requests of /v1/completions and /v1/chat/completions (with vLLM's
sampling extensions) and every response, streamed or not.

Requests are parsed strictly (a string where a number belongs is a 400, not coerced). Unknown
fields are ignored with a logged warning, as vLLM does; fields we know but do not implement yet
(functions, use_beam_search, ...) are a 400 naming them, never ignored. Structured outputs and
tools are checked in structured_outputs.py and tool_calls.py. Every
integer the nodes receive fits int32 (seeds int64), and no string may hold a lone surrogate.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

_INT32 = 1 << 31
Int32 = Annotated[int, Field(ge=-_INT32, lt=_INT32)]
"""An integer the wire carries as int32: larger ones are a 400, not a failure later."""
TokenId = Annotated[int, Field(ge=0, lt=_INT32)]
_SURROGATE = re.compile("[\ud800-\udfff]")
LOGIT_BIAS_LIMIT = 100.0

MAX_N = 16
"""Most completions one request may ask for."""
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
"""Most top logprobs per token (the engine's limit)."""
_INT64 = 1 << 63

FinishReason = Literal["stop", "length", "tool_calls"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in value holding a lone surrogate, if any."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return where
            found = _find_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_surrogate(item, f"{path}.[{i}]" if path else f"[{i}]")
            if found:
                return found
    return None


class TopLevelRequest(_Request):
    """A whole request body: checked for lone surrogates (they cannot be encoded, so the
    tokenizer and the wire would fail on them), and unknown fields logged."""

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        if isinstance(data, dict):
            where = _find_surrogate(data, "")
            if where is not None:
                where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold it
                raise ValueError(f"{where} holds a lone surrogate (not valid Unicode)")
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                logger.warning("fields present in the request but ignored: %s", unknown)
        return data


UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "guided_whitespace_pattern",
    "use_beam_search",
    "logits_processors",
    "prompt_embeds",
    "chat_template",
    "documents",
    "mm_processor_kwargs",
    "vllm_xargs",
    "kv_transfer_params",
)
"""Parameters of OpenAI's or vLLM's API that pdserve does not implement yet: a 400 naming
them when set, never silently ignored."""


_ENDPOINT_ONLY = (
    "functions",
    "function_call",
    "chat_template",
    "documents",
    "mm_processor_kwargs",
)
"""The unsupported fields only chat requests have."""


def _reject_unsupported(cls: Any, value: Any, info: Any) -> Any:
    if value is not None and value is not False:
        raise ValueError(f"{info.field_name} is not supported by this server yet")
    return value


class StreamOptions(_Request):
    """stream_options: include_usage adds a last chunk with empty choices and the usage."""

    include_usage: bool = False


class SamplingRequest(TopLevelRequest):
    """The fields both endpoints share: OpenAI's, then vLLM's extensions."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int32 | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: Int32 = Field(0, ge=0)
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool = False
    """vLLM: the prompt's and each choice's token ids in the response."""
    return_tokens_as_token_ids: bool = False
    """vLLM: logprobs name tokens "token_id:{id}" instead of by their text."""
    truncate_prompt_tokens: Int32 | None = Field(None, ge=1)
    """vLLM: keep only the prompt's last k tokens."""
    cache_salt: str | None = None
    priority: Int32 = 0
    # Structured outputs (checked and converted by structured_outputs.py)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    prompt_logprobs: Int32 | None = None
    """vLLM: each prompt token's logprob plus this many top ones (0..20), not streamable."""
    # Known, not implemented yet: a 400 when set (see UNSUPPORTED_FIELDS).
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    _check_unsupported = field_validator(
        *(f for f in UNSUPPORTED_FIELDS if f not in _ENDPOINT_ONLY), mode="before"
    )(_reject_unsupported)

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> SamplingRequest:
        n = self.prompt_logprobs
        if n is None:
            return self
        if n < -1:
            raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        if n == -1 or n > MAX_LOGPROBS:
            asked = "the whole vocabulary" if n == -1 else str(n)
            raise ValueError(
                f"prompt_logprobs asks for {asked}; this server returns at most {MAX_LOGPROBS}"
            )
        if self.stream and n > 0:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("stop_token_ids must be >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) >= _INT32:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {value}"
                )
        return bias

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not ids:
            raise ValueError("allowed_token_ids must not be empty")
        return ids

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed")
        return self

    @property
    def num_candidates(self) -> int:
        """Completions generated per prompt (best_of; n of them are returned)."""
        return self.best_of or self.n

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to compute: prompt_logprobs, or (echo with logprobs) as many
        as logprobs, since the echoed prompt's tokens then have logprobs too (vLLM's rule)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ContentPart(_Request):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _check_text(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported")
        if self.text is None:
            raise ValueError("a text content part needs `text`")
        return self


class ChatMessage(_Request):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's calls ({"id", "type", "function": {"name", "arguments"}})."""

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}
)
"""Template variables the gateway itself sets: chat_template_kwargs may not name them."""


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = Field(None, ge=1)
    max_completion_tokens: Int32 | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Known, not implemented yet: a 400 when set (see UNSUPPORTED_FIELDS).
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None

    _check_chat_unsupported = field_validator(*_ENDPOINT_ONLY, mode="before")(_reject_unsupported)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
        if clash:
            raise ValueError(
                f"chat_template_kwargs may not set {clash}: use the request's own fields"
            )
        return kwargs

    @model_validator(mode="after")
    def _check_continue_final_message(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens


# ----- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """usage.prompt_tokens_details."""

    cached_tokens: int = 0
    """Prompt tokens served from a prefix cache."""


class UsageInfo(BaseModel):
    """Token counts of a request (the prompt counted once for all n completions)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The completions endpoint's logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


def fingerprint(model_version: str) -> str | None:
    """OpenAI's system_fingerprint for a node's model_version (None when unknown)."""
    return f"fp_{model_version}" if model_version else None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's logprob at a prompt position (prompt_logprobs entries)."""

    logprob: float
    rank: int | None = None
    """1-based rank among the whole vocabulary."""
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its logprob;
the prompt token first, then the top ones."""


class CompletionChoice(BaseModel):
    """One completion of /v1/completions (in a chunk: its new text)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """vLLM's extension: the stop string or stop token id that ended the completion."""
    prompt_token_ids: list[int] | None = None
    """vLLM's return_token_ids: the choice's prompt (streamed: in its first chunk only)."""
    token_ids: list[int] | None = None
    """vLLM's return_token_ids: the choice's generated tokens (streamed: the new ones)."""
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's prompt_logprobs (streamed: in the choice's first chunk)."""


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of it (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    """The version of the weights that produced it (fingerprint())."""
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token at a position (chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    """One generated token's logprob with its alternatives (chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """choices[].logprobs of a chat completion."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    """A tool call's function and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of the assistant's message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    """A streamed tool call (its index in the message's tool_calls)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message in a chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One completion of /v1/chat/completions."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM's return_token_ids: the generated tokens."""


class ChatCompletionResponse(BaseModel):
    """The whole chat completion (stream=false)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    """The version of the weights that produced it (fingerprint())."""
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    """vLLM's return_token_ids: the templated prompt."""
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's prompt_logprobs of the templated prompt."""


class DeltaMessage(BaseModel):
    """What a chat chunk adds to the message."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    """One completion's part of a chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """vLLM's return_token_ids: the tokens this chunk adds."""


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """vLLM's return_token_ids: the prompt, in the first chunk only."""
    prompt_logprobs: PromptLogprobs | None = None
    """prompt_logprobs (0 top ones: more cannot be streamed), with the first tokens."""


class ModelPermission(BaseModel):
    """vLLM's model permission entry (what the server lets clients do with the model)."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """One entry of GET /v1/models (vLLM's fields)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model in vLLM; None for a base model."""
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
