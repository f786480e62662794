"""engine.tokenizer against transformers' AutoTokenizer on the same directories, and the
incremental detokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import pytest

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "def foo(x):\n    return x + 1  # comment\n\n\n",
    "  leading and trailing  \t\n",
    "héllo wörld — naïve café; 你好，世界 🙂👍🏽 Ελληνικά",
    "Cafe\u0301 vs Café (NFC), ﬁ ligature",
    "I'm sure they'll say WE'VE won 1234567 times",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|pad|>with<|end_of_text|>specials<|begin_of_text|>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 🙂"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Callable[[str], str]) -> Callable[[str], tuple[Tokenizer, object]]:
    """arch -> (our tokenizer, transformers' AutoTokenizer) for its tiny model."""
    from transformers import AutoTokenizer

    cache: dict[str, tuple[Tokenizer, object]] = {}

    def get(arch: str) -> tuple[Tokenizer, object]:
        if arch not in cache:
            model_dir = tiny_model_dir(arch)
            cache[arch] = (
                Tokenizer.from_pretrained(model_dir),
                AutoTokenizer.from_pretrained(model_dir),
            )
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_decode_match_transformers(arch: str, pair: Callable) -> None:
    ours, hf = pair(arch)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize("arch", ARCHS)
def test_special_tokens_match_transformers(arch: str, pair: Callable) -> None:
    ours, hf = pair(arch)
    assert ours.vocab_size == len(hf)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        hf.eos_token_id,
        hf.bos_token_id,
        hf.pad_token_id,
    )
    assert ours.eos_token_id is not None
    starts_with_bos = ours.encode("x")[0] == ours.bos_token_id
    assert starts_with_bos == (arch in ("llama", "mistral"))


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_matches_transformers(arch: str, pair: Callable) -> None:
    ours, hf = pair(arch)
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
    text = ours.apply_chat_template(MESSAGES[:2])
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode(text, add_special_tokens=False) == hf.apply_chat_template(
        MESSAGES[:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_custom_chat_template_and_special_tokens_map(tiny_llama: str, tmp_path) -> None:
    """A template using jinja features transformers enables (loop controls, trim_blocks,
    tojson without HTML escaping, raise_exception), and special tokens that only
    special_tokens_map.json names (no added_tokens_decoder in tokenizer_config.json)."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key in ("added_tokens_decoder", "eos_token", "pad_token"):
        config.pop(key)
    config["chat_template"] = (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n"
        "  {% if loop.index > 3 %}{% break %}{% endif %}\n"
        "{{ m['role'] }}: {{ m | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = (
        Tokenizer.from_pretrained(str(model_dir)),
        AutoTokenizer.from_pretrained(str(model_dir)),
    )
    assert ours.eos_token_id == hf.eos_token_id == 3
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(MESSAGES) == expected
    assert "🙂" in expected and "<" in expected  # no ASCII / HTML escaping
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
@pytest.mark.parametrize("chunk", (1, 3))
def test_incremental_detokenizer(arch: str, chunk: int, pair: Callable) -> None:
    ours, _ = pair(arch)
    prompt = ours.encode("Say something: ")
    text = "naïve 你好🙂👍🏽 done<|im_end|> après\n\tx"
    output = ours.encode(text, add_special_tokens=False)
    # The vocabulary splits these characters across tokens: the test exercises the hold-back.
    assert any(ours.decode(output[:i]).endswith("\ufffd") for i in range(1, len(output)))
    for skip in (True, False):
        detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, output, chunk)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == ours.decode(output, skip_special_tokens=skip)
        assert detok.finish() == ""


def test_incremental_detokenizer_flushes_incomplete_character(pair: Callable) -> None:
    ours, _ = pair("qwen3")
    output = ours.encode("ok 🙂", add_special_tokens=False)
    cut = next(i for i in range(len(output), 0, -1) if ours.decode(output[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(ours, [], skip_special_tokens=True)
    streamed = "".join(_stream(detok, output[:cut], 1))
    assert "\ufffd" not in streamed
    assert streamed + detok.finish() == ours.decode(output[:cut])


def test_missing_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))


def test_read_chat_template_takes_a_file_or_the_template(tmp_path) -> None:
    from pdserve.engine.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="does not exist"):
        read_chat_template(str(tmp_path / "missing.jinja"))
