"""Bad input gets a ValueError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", max_model_len=256, num_blocks=64)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(min_p=2.0), "min_p must be in"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens must be in"),
        (dict(n=0), "n must be >= 1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_while_engine_keeps_serving(llm):
    engine = llm.engine
    good = [
        engine.add_request(f"good{i}", [5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=8))
        for i in range(3)
    ]
    engine.step()
    bad = [
        ([], "prompt is empty"),
        ([1, engine.vocab_size], "outside the vocabulary"),
        ([-1, 2], "outside the vocabulary"),
        (list(range(10, 250)), "exceeds max_model_len 256"),
    ]
    for i, (prompt, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad{i}", prompt, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good0", [1, 2], SamplingParams())
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert all(r.num_output_tokens == 8 and r.finished for r in good)
    assert engine.kv.num_free_blocks == engine.num_blocks - 1


def test_generate_validates_all_before_queueing_any(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_bad_model_directories(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found|missing"):
        LLM(model=str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(empty))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_llama, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors|weights"):
        LLM(model=str(no_weights))
    odd = tmp_path / "odd"
    shutil.copytree(tiny_llama, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(odd))


def test_bad_engine_config(tiny_llama):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=tiny_llama, dtype="float16")
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=tiny_llama, block_size=12)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_llama, max_model_len=10**7)
