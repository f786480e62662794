"""The vocabulary of one engine step, in the order data flows through it.

schedule() plans a `SchedulerOutput` (a `ScheduledChunk` per request, plus the `RemotePrefill`
reservations a decode node hands to prefill nodes); the model runner returns `SampledTokens` per
request; update_from_output() folds them in and reports a `RequestUpdate` per request that got
tokens (a request's new tokens: the one name for them); LLMEngine.step() returns both kinds of
result as one `StepOutput`, which the offline LLM reads and the node's engine loop delivers to
each request's stream. `EngineLoad` is the engine's load, as node reports and metrics read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import RequestStatus, TokenLogprobs


@dataclass
class ScheduledChunk:
    """One request's work in a step: compute token positions [start_pos, start_pos + len)."""

    request_id: str
    token_ids: list[int]
    """Tokens to compute (prompt chunk, last sampled token, then any speculative tokens)."""
    start_pos: int
    """Position of token_ids[0] (= num_computed_tokens before the step)."""
    block_ids: list[int]
    """Every block the request holds, in position order."""
    num_spec_tokens: int
    """How many of token_ids' trailing tokens are speculative (to verify)."""
    samples: bool
    """Whether this chunk reaches the end of the known tokens, so a token is sampled."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with (None: the base model)."""


@dataclass
class RemotePrefill:
    """A request admitted with its prompt's blocks reserved, to be filled by a prefill node."""

    request_id: str
    block_ids: list[int]
    """Every block reserved for the prompt, in position order."""
    num_local_cached_tokens: int
    """Leading prompt tokens already in this node's prefix cache (a multiple of the block
    size): their blocks need no transfer."""


@dataclass
class SchedulerOutput:
    """What to compute in one step, in batch order."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests freed since the previous step (aborted), so workers can drop their state."""
    remote_prefills: list[RemotePrefill] = field(default_factory=list)
    """Requests admitted this step whose prompt KV must come from a prefill node."""

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledTokens:
    """What the model produced for one request in one step."""

    token_ids: list[int]
    """Accepted tokens (1 without speculation; 1 + accepted drafts with it)."""
    logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestUpdate:
    """A request's new tokens after a step, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    status: RequestStatus
    num_cached_tokens: int = 0
    """Prompt tokens served from a prefix cache at admission."""
    scheduled_s: float | None = None
    """When the request was first scheduled (time.monotonic(), the start of that step): its
    blocks reserved (decode: also for a remote prefill) or its first tokens computed."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the request's first update, when SamplingParams.prompt_logprobs asked: one entry per
    prompt token, None for the first."""


@dataclass
class StepOutput:
    """Everything one LLMEngine.step() produced, per request."""

    updates: list[RequestUpdate] = field(default_factory=list)
    """Requests that got new tokens (or finished) in this step."""
    remote_prefills: list[RemotePrefill] = field(default_factory=list)
    """Decode role: requests admitted with blocks reserved, for a prefill node to fill. Each
    ends with LLMEngine.finish_remote_prefill() or fail_remote_prefill() on the engine thread."""

    def __bool__(self) -> bool:
        return bool(self.updates or self.remote_prefills)


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load. Safe to take from any thread (plain reads; at worst one
    step stale): node load reports and the metrics scrape read it while the engine runs."""

    num_running: int
    """Requests in the running batch."""
    num_waiting: int
    """Requests queued for admission."""
    num_awaiting_kv: int
    """Admitted requests whose prompt KV a prefill node is computing."""
    remote_prefill_backlog: int
    """Uncached prompt tokens this node waits for from prefill nodes."""
    local_prefill_backlog: int
    """Prompt tokens of running requests still to be computed here."""
    num_free_blocks: int
    """KV blocks free or evictable (cached, unreferenced)."""
    num_total_blocks: int
    """Usable KV blocks (the null block not counted)."""
    kv_cache_usage: float
    """Fraction of KV blocks in use, 0..1."""
    num_preemptions: int
    """Requests preempted so far."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found."""
    num_prompt_tokens: int
    """Prompt tokens computed so far (recomputation included)."""
    num_generation_tokens: int
    """Tokens generated so far."""
