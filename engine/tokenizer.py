"""Tokenizer (the ``tokenizers`` library on tokenizer.json, no transformers) and the incremental
detokenizer used for streaming.

``Tokenizer.from_pretrained`` reproduces what transformers' AutoTokenizer does for a directory
with a tokenizer.json: special tokens from tokenizer_config.json (or special_tokens_map.json),
bos/eos from tokenizer.json's post-processor (as transformers 5 does), and chat templates
rendered with the same sandboxed jinja2 environment.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: str, {"content": ...} or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, str]:
    # transformers 5 reads special_tokens_map.json only when tokenizer_config.json has no
    # added_tokens_decoder, and then lets it override tokenizer_config.json.
    merged = dict(config)
    if "added_tokens_decoder" not in config:
        merged.update(special_map)
    tokens = {key: _token_str(merged.get(key)) for key in _SPECIAL_TOKEN_KEYS}
    return {key: token for key, token in tokens.items() if token is not None}


def _chat_template(model_dir: str, config: dict[str, Any]) -> str | None:
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile like transformers' chat_template_utils: sandboxed, trim/lstrip blocks,
    loop controls, non-escaping tojson, raise_exception and strftime_now."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


_GIL_FREE_CHARS = 16_384
"""Texts longer than this are encoded through encode_batch, which runs without the GIL."""


class Tokenizer:
    """Text <-> token ids for one model directory, plus its chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        clean_up_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        """Named special tokens ("bos_token", "eos_token", ...) -> token text."""
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._clean_up_spaces = clean_up_spaces

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ special_tokens_map.json,
        chat_template.jinja) from model_dir (a GGUF file: from its converted directory)."""
        from pdserve.engine.models import gguf  # imports nothing heavy until it converts

        model_dir = gguf.model_dir(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(
                gguf.tokenizer_missing_message(model_dir) or f"{model_dir!r} has no tokenizer.json"
            )
        backend = HFTokenizer.from_file(path)
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        special = _special_tokens(
            config, _read_json(os.path.join(model_dir, "special_tokens_map.json"))
        )
        missing = [t for t in special.values() if backend.token_to_id(t) is None]
        if missing:  # transformers adds named special tokens the vocabulary lacks
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )
        # Like transformers 5: with a tokenizer.json, its post-processor alone decides bos/eos
        # (tokenizer_config.json's add_bos_token / add_eos_token are ignored).
        is_bpe = type(backend.model).__name__ == "BPE"
        clean = bool(config.get("clean_up_tokenization_spaces", False)) and not is_bpe
        return cls(backend, special, _chat_template(model_dir, config), clean)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens adds bos/eos as the tokenizer is configured
        (pass False for text rendered by a chat template that already holds them)."""
        if len(text) > _GIL_FREE_CHARS:
            # tokenizers' encode() holds the GIL throughout (a 3 MB prompt: ~8 s with every
            # other thread stopped, the gateway's event loop included); encode_batch releases it
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up_spaces else text

    def set_chat_template(self, template: str) -> None:
        """Use template instead of the model's (vLLM's --chat-template); ValueError if it does
        not compile."""
        try:
            compiled = _compile_chat_template(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e} (line {e.lineno})") from e
        self.chat_template = template
        self._compiled_template = compiled

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template (text; encode it with
        add_special_tokens=False). kwargs are passed to the template (e.g. tools)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        return self._compiled_template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file holding a Jinja template, or the template itself (a value
    with a Jinja delimiter or a newline). ValueError for a file that does not exist."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(marker in value for marker in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"chat template file {value!r} does not exist")


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas.

    Decodes a short window of ids (the last few already-emitted ones as context, so that
    tokenizers which look at neighbours decode spaces right) and emits what the window adds.
    Text ending in U+FFFD is held back: byte-level BPE splits multi-byte UTF-8 characters across
    tokens, and the character is emitted once its last byte arrives. For byte-level tokenizers
    the deltas concatenate to ``decode(output_ids)`` (plus ``finish()`` for a sequence that
    ends inside a character).
    """

    _CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids)
        # Invariant: ids[prefix_offset:read_offset] decode to text already accounted for;
        # ids[read_offset:] have not been emitted yet.
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - self._CONTEXT_TOKENS, 0)
        self.output_text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append new_ids; return the new text they complete (may be "")."""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back at the end of the stream (an incomplete character decodes to
        U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = self._decode(self.prefix_offset)[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
