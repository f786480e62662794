"""A request's parameters, state and results."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.structured_output import StructuredOutputSpec

if TYPE_CHECKING:
    from pdserve.engine.structured_output import GrammarMatcher

MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0
"""OpenAI's range for logit_bias values."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, named and defaulted like vLLM's."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1, as in vLLM) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """HF-style: divide positive logits (multiply negative ones) of tokens already in prompt or output."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtract once for each token already in the output."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtract per occurrence of the token in the output."""
    seed: int | None = None
    """Makes sampling a pure function of (seed, position); None draws one per request."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Fewest tokens to generate before eos / stop_token_ids may end the request."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (kept in the output, like eos)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request (cut from the text; applied by the detokenizing layer)."""
    ignore_eos: bool = False
    """Keep generating past eos."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs (0..20)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (after the first) plus this many top logprobs
    (0..20). The prompt is then computed whole, here: no prefix-cache hit, no remote prefill."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    n: int = 1
    """Completions per prompt (fanned out into n requests)."""
    logit_bias: dict[int, float] | None = None
    """token id -> value added to its logit before sampling (OpenAI's; values in
    [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT])."""
    allowed_token_ids: tuple[int, ...] | None = None
    """When set (non-empty), only these tokens may be sampled."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never to generate: a sequence's last token is forbidden wherever the
    output ends with the rest of it (vLLM's bad_words, tokenized by the caller)."""
    structured_output: StructuredOutputSpec | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar
    (engine/structured_output.py)."""
    structured_output_resume: int = 0
    """The last this many prompt tokens were generated under structured_output (a request
    resumed elsewhere with its tokens so far): the matcher accepts them before sampling."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(t): float(v) for t, v in self.logit_bias.items()}
            )
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bad_words = tuple(tuple(word) for word in self.bad_words_token_ids)
        object.__setattr__(self, "bad_words_token_ids", bad_words)
        self._validate()

    def _validate(self) -> None:
        if self.structured_output_resume < 0 or (
            self.structured_output_resume and self.structured_output is None
        ):
            raise ValueError(
                "structured_output_resume must be >= 0, and 0 without structured_output, got "
                f"{self.structured_output_resume}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 for all), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        self._validate_token_constraints()

    def _validate_token_constraints(self) -> None:
        """Token ids must be >= 0 here; the engine checks them against its vocabulary."""
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {token}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], "
                    f"got {bias}"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be >= 0")
        for word in self.bad_words_token_ids:
            if not word or any(t < 0 for t in word):
                raise ValueError("each bad word must be a non-empty list of token ids >= 0")

    def token_ids_used(self) -> list[int]:
        """Every token id named by logit_bias, allowed_token_ids or bad words (for the
        engine's vocabulary check)."""
        words = [t for word in self.bad_words_token_ids for t in word]
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or ()), *words]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class RequestStatus(enum.Enum):
    """Where a request is in its life. Finished states map to OpenAI's finish_reason."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_PREFILLED = enum.auto()
    """Prefill role: the first token is sampled; the decode node continues the request."""

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length", "abort", or None while unfinished (a
        prefill-only request's is None too: it is not finished for the client)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: None,
}


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token among all tokens."""
    top: dict[int, float]
    """token id -> logprob of the N most likely tokens (N = SamplingParams.logprobs)."""


@dataclass(eq=False)
class Request:
    """One sequence being generated. Progress is counters, not phases: num_computed_tokens
    catches up with num_tokens; the request samples when it has computed all of them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end the request unless ignore_eos (all of generation_config's eos ids)."""
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    seed: int = 0
    """The effective sampling seed (SamplingParams.seed or one drawn for the request)."""
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative tokens proposed for the next step (not yet part of num_tokens)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of this request's full blocks, computed incrementally."""
    wants_remote_prefill: bool = False
    """Decode role: at first admission, reserve the prompt's blocks and have a prefill node
    fill them (cleared once offered: a preempted request recomputes locally)."""
    prefill_only: bool = False
    """Prefill role: the request ends once its first token is sampled (FINISHED_PREFILLED);
    its KV goes on to a decode node, which generates the rest."""
    scheduled_s: float | None = None
    """When the request was first scheduled (time.monotonic() at the start of that step)."""
    grammar: GrammarMatcher | None = None
    """The structured-output matcher, advanced with every output token (None: unconstrained)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """SamplingParams.prompt_logprobs: one entry per prompt token scored so far (the first
    token's is None), filled as its prompt chunks are computed; reported with the first
    output token."""
    prompt_logprobs_reported: bool = False
    lora_request: LoRARequest | None = None
    """The LoRA adapter to run with (None: the base model)."""

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens in the half-open interval [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


@dataclass
class CompletionOutput:
    """One generated sequence, shaped like vLLM's."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """What the engine reports for a request, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt token (None for the first), when SamplingParams.prompt_logprobs asked."""
    lora_request: LoRARequest | None = None
