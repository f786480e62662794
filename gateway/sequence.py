"""SequenceOutput: one completion's tokens turned into text, cut at stop strings, with its
finish reason. It does not care which decode node (or how many, after a resubmission) produced
the tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.gateway.stop_strings import StopStringMatcher
from pdserve.v1 import common_pb2, node_pb2

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass
class CompletionDelta:
    """What one of a request's n completions added since its previous delta."""

    index: int
    """Which completion (0-based)."""
    text: str
    """New text (whole characters; never text a stop string later cuts)."""
    token_ids: list[int] = field(default_factory=list)
    """New token ids (all sampled tokens, even those past a stop string's cut)."""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    """Logprobs of token_ids, when asked for."""
    finish_reason: str | None = None
    """"stop" or "length" on the completion's last delta."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it (None for eos or length)."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens a prefix cache served (known from the first node answer on)."""
    num_output_tokens: int = 0
    """Tokens generated so far."""
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None
    """On the completion's first delta, when SamplingParams.prompt_logprobs asked: prompt
    tokens 1..n-1's logprobs."""
    model_version: str = ""
    """The version of the weights producing the completion ("" before the first answer)."""


class SequenceOutput:
    """Detokenizer + stop strings + counters for one completion."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: common_pb2.SamplingParams,
    ) -> None:
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        skip_special = (
            params.skip_special_tokens if params.HasField("skip_special_tokens") else True
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special)
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs: list[common_pb2.TokenLogprob] | None = None
        """Prompt tokens 1..n-1's logprobs (when asked), from the first node answer; a
        resubmission does not ask again."""
        self.model_version: str | None = None
        """The version of the weights that produced it (the first node answer's): a
        resubmission goes only to nodes of this version."""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one matched)."""
        return self._matcher.text

    def add_chunk(self, chunk: node_pb2.TokenChunk) -> CompletionDelta:
        """Take one TokenChunk from a decode node. An ABORT finish is not applied: the node
        gave up, and the caller resubmits the sequence elsewhere."""
        prompt_logprobs = None
        if self.num_cached_tokens is None:
            # Only the first node's count is the prompt's: a resubmission's "prompt" includes
            # tokens this sequence generated.
            self.num_cached_tokens = min(chunk.num_cached_tokens, len(self.prompt_token_ids))
            prompt_logprobs = self.prompt_logprobs = list(chunk.prompt_logprobs)
            self.model_version = chunk.model_version
        token_ids = list(chunk.token_ids)
        self.output_token_ids.extend(token_ids)
        match = self._matcher.feed(self._detokenizer.add(token_ids))
        text = match.text
        if match.stop is not None:
            self.finish_reason, self.stop_reason = "stop", match.stop
        elif chunk.finish_reason in _FINISH_REASONS:
            text += self.finish(_FINISH_REASONS[chunk.finish_reason])
        delta = self._delta(text, token_ids, list(chunk.logprobs))
        delta.prompt_logprobs = prompt_logprobs
        return delta

    def finish(self, reason: str) -> str:
        """End the sequence without a stop string match: flush the held text and return it."""
        self.finish_reason = reason
        last = self.output_token_ids[-1] if self.output_token_ids else None
        if last is not None and last in self.stop_token_ids:
            self.stop_reason = last
        return self._matcher.flush(self._detokenizer.finish())

    def finish_delta(self, reason: str) -> CompletionDelta:
        """finish() as a delta of its own."""
        return self._delta(self.finish(reason), [], [])

    def _delta(
        self, text: str, token_ids: list[int], logprobs: list[common_pb2.TokenLogprob]
    ) -> CompletionDelta:
        return CompletionDelta(
            index=self.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens or 0,
            num_output_tokens=len(self.output_token_ids),
            model_version=self.model_version or "",
        )


@dataclass
class FinalOutput:
    """One completion, whole (for non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None
    model_version: str = ""

    def add(self, delta: CompletionDelta) -> None:
        self.model_version = delta.model_version or self.model_version
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens


async def collect(deltas: AsyncIterator[CompletionDelta], n: int) -> list[FinalOutput]:
    """Drain a request's deltas into its n whole completions, in index order."""
    outputs = [FinalOutput(i) for i in range(n)]
    async for delta in deltas:
        outputs[delta.index].add(delta)
    return outputs
