"""Logprobs in OpenAI's two shapes, and vLLM's prompt_logprobs, from the nodes' TokenLogprob
messages.

Completions: parallel lists {tokens, token_logprobs, top_logprobs, text_offset} (with echo,
the prompt's tokens first: the first one has no logprob).
Chat: content[] of {token, logprob, bytes, top_logprobs[]}.
prompt_logprobs: per prompt token, None for the first, then {token id: {logprob, rank,
decoded_token}} with the prompt token first and the top ones after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_api import (
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from pdserve.v1 import common_pb2

# JSON has no -inf; vLLM clamps the same way.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """Each token's text and raw bytes (a byte-level token may hold part of a character: its
    text is U+FFFD, its bytes are exact)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        backend = tokenizer.backend
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        if token_id in self._added:
            return list(self._added[token_id].encode())
        piece = self._tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return list(self._text(token_id).encode())
        if self._byte_level:
            decoder = _byte_decoder()
            if all(ch in decoder for ch in piece):
                return [decoder[ch] for ch in piece]
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]  # sentencepiece byte fallback
        return list(self._text(token_id).encode())


def _namer(texts: TokenTexts, as_token_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or vLLM's "token_id:{id}"
    (return_tokens_as_token_ids)."""
    return (lambda token_id: f"token_id:{token_id}") if as_token_ids else texts.text


def completion_logprobs(
    entries: Sequence[common_pb2.TokenLogprob],
    texts: TokenTexts,
    text_offset: int,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """The completions shape for entries, whose first token starts at text_offset characters
    into the completion. top_logprobs holds the sampled token plus the top ones, as vLLM's."""
    name = _namer(texts, as_token_ids)
    out = CompletionLogprobs()
    for entry in entries:
        token = name(entry.token_id)
        top = {name(t.token_id): _clamp(t.logprob) for t in entry.top}
        top[token] = _clamp(entry.logprob)
        out.tokens.append(token)
        out.token_logprobs.append(_clamp(entry.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(texts.text(entry.token_id))
    return out


def chat_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], texts: TokenTexts, as_token_ids: bool = False
) -> list[ChatTokenLogprob]:
    """The chat shape (choices[].logprobs.content) for entries."""
    name = _namer(texts, as_token_ids)
    return [
        ChatTokenLogprob(
            token=name(entry.token_id),
            logprob=_clamp(entry.logprob),
            bytes=texts.bytes(entry.token_id),
            top_logprobs=[
                TopLogprob(
                    token=name(t.token_id),
                    logprob=_clamp(t.logprob),
                    bytes=texts.bytes(t.token_id),
                )
                for t in entry.top
            ],
        )
        for entry in entries
    ]


def echo_logprobs(
    prompt_token_ids: Sequence[int],
    prompt_entries: Sequence[common_pb2.TokenLogprob],
    entries: Sequence[common_pb2.TokenLogprob],
    texts: TokenTexts,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """The completions shape with echo: the prompt's tokens (the first has no logprob, None as
    in vLLM's; the others prompt_entries'), then the generated ones (entries), offsets from 0."""
    name = _namer(texts, as_token_ids)
    first = prompt_token_ids[0]
    out = CompletionLogprobs(
        tokens=[name(first)], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    rest = completion_logprobs(
        [*prompt_entries, *entries], texts, len(texts.text(first)), as_token_ids
    )
    out.tokens += rest.tokens
    out.token_logprobs += rest.token_logprobs
    out.top_logprobs += rest.top_logprobs
    out.text_offset += rest.text_offset
    return out


def prompt_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], texts: TokenTexts, as_token_ids: bool = False
) -> PromptLogprobs:
    """vLLM's prompt_logprobs for prompt tokens 1..n-1's entries (the first token's is None)."""
    name = _namer(texts, as_token_ids)
    out: PromptLogprobs = [None]
    for entry in entries:
        position = {
            str(entry.token_id): PromptLogprob(
                logprob=_clamp(entry.logprob), rank=entry.rank, decoded_token=name(entry.token_id)
            )
        }
        for rank, top in enumerate(entry.top, start=1):
            position.setdefault(
                str(top.token_id),
                PromptLogprob(
                    logprob=_clamp(top.logprob), rank=rank, decoded_token=name(top.token_id)
                ),
            )
        out.append(position)
    return out
