"""Gemma 3 against transformers' Gemma3ForCausalLM (fp32): prompt logits, chunked prefill and
decode over the paged KV cache, and greedy generation through the engine, on a tiny random
model whose sliding window (16) is far shorter than its sequences. Also: which sliding windows
the loader still refuses, and the Gemma 3 config forms it reads."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams, model_runner
from pdserve.engine.models.gemma3 import Gemma3ForCausalLM
from pdserve.engine.models.loader import load_model, parse_model_arch
from tests.engine.models.test_llama_vs_hf import PagedSeqs, assert_close, random_ids

WINDOW = 16
VOCAB = 300
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]

torch.set_num_threads(2)


def _save_tokenizer(out: Path) -> None:
    """A word-level tokenizer over the model's ids ("t0" .. "t299"; Gemma's pad 0, eos 1,
    bos 2): the engine loads one, the tests pass token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    special = {"pad_token": "t0", "eos_token": "t1", "bos_token": "t2", "unk_token": "t3"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "special_tokens_map.json").write_text(json.dumps(special))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Gemma 3 written by transformers: 4 layers (3 sliding, window 16), MQA
    (2 heads, 1 kv head), head_dim 32, query_pre_attn_scalar apart from head_dim, tied
    embeddings. Weights are noised (norms included, so a norm left at its init is caught), q/k
    the most (peaked attention, which the window changes most); the tied embedding stays small
    (or each token predicts itself): greedy output varies."""
    from transformers import Gemma3ForCausalLM as HFGemma3
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    hf = HFGemma3(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0.0, 0.02)
            else:
                p.add_((1.0 if "q_proj" in name or "k_proj" in name else 0.3) * torch.randn_like(p))
    out = tmp_path_factory.mktemp("tiny_gemma3")
    hf.save_pretrained(out)
    _save_tokenizer(out)
    return str(out)


_HF: dict[str, torch.nn.Module] = {}


def hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF[model_dir]


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def model(gemma3_dir: str) -> Gemma3ForCausalLM:
    loaded, _ = load_model(gemma3_dir, "float32")
    assert isinstance(loaded, Gemma3ForCausalLM)
    return loaded


# ---- the model over the paged cache vs transformers' forward --------------------------------


def test_config_parsed(gemma3_dir: str) -> None:
    arch = parse_model_arch(gemma3_dir)
    assert arch.architecture == "Gemma3ForCausalLM"
    assert arch.layer_sliding == (True, True, False, True)
    assert (arch.sliding_window, arch.rope_theta, arch.local_rope_theta) == (16, 1e6, 1e4)
    assert (arch.head_dim, arch.query_pre_attn_scalar, arch.qk_norm) == (32, 24.0, True)
    assert arch.tie_word_embeddings
    assert arch.final_logit_softcapping is None and arch.rope_scaling is None


def test_prompt_logits_match_hf(gemma3_dir: str, model, layer_kernels: str) -> None:
    """Prompts shorter than, as long as and longer than the window in one step (the 1-token
    one takes the decode path)."""
    prompts = {f"p{n}": random_ids(n, VOCAB, seed=n) for n in (1, 9, 16, 17, 40, 100)}
    logits = PagedSeqs(model).step(list(prompts.items()))
    for ids, ours in zip(prompts.values(), logits, strict=True):
        assert ours.shape == (len(ids), VOCAB)
        assert_close(ours, hf_logits(gemma3_dir, ids))


def test_chunked_prefill_and_decode_match_hf(gemma3_dir: str, model, layer_kernels: str) -> None:
    """Prefill chunks over cached context longer than the window (window starts inside a
    block), then batched decodes whose windows slide across block boundaries."""
    a, b = random_ids(70, VOCAB, 1), random_ids(23, VOCAB, 2)
    runner = PagedSeqs(model)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    la, lb = runner.step([("a", a[:25]), ("b", b[:5])])
    got["a"].append(la), got["b"].append(lb)
    la, lb = runner.step([("a", a[25:50]), ("b", b[5:])])
    got["a"].append(la), got["b"].append(lb)
    got["a"].append(runner.step([("a", a[50:])])[0])
    seqs = {"a": list(a), "b": list(b)}
    for _ in range(20):
        batch = [(s, [int(got[s][-1][-1].argmax())]) for s in seqs]
        for (s, tok), out in zip(batch, runner.step(batch), strict=True):
            seqs[s] += tok
            got[s].append(out)
    for s, ids in seqs.items():
        assert_close(torch.cat(got[s])[: len(ids)], hf_logits(gemma3_dir, ids))


def test_bfloat16_smoke(gemma3_dir: str, layer_kernels: str) -> None:
    """bf16 weights and KV (padded rows, fused RoPE) stay close to transformers' fp32 logits,
    prefill and decode past the window."""
    model, _ = load_model(gemma3_dir, "bfloat16")
    assert model.embed_scale.dtype == torch.bfloat16
    ids = random_ids(50, VOCAB, 5)
    runner = PagedSeqs(model)
    ours = [runner.step([("a", ids[:40])])[0]]
    ours += [runner.step([("a", [t])])[0] for t in ids[40:]]
    ref = hf_logits(gemma3_dir, ids)
    got = torch.cat(ours)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_window_is_what_makes_it_match(gemma3_dir: str, model, monkeypatch) -> None:
    """Guard on the tests above: without the window the same model is far off transformers
    past the window, and equal within it."""
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "window", None)
    short, long = random_ids(WINDOW, VOCAB, 5), random_ids(60, VOCAB, 6)
    ours_short, ours_long = PagedSeqs(model).step([("s", short), ("l", long)])
    assert_close(ours_short, hf_logits(gemma3_dir, short))
    assert (ours_long - hf_logits(gemma3_dir, long)).abs().max() > 1e-2


def _rewrite_config(src: str, dst: Path, drop: tuple[str, ...] = (), **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_final_logit_softcapping_and_rope_scaling_match_hf(gemma3_dir: str, tmp_path) -> None:
    """Logit softcapping and linear RoPE scaling of the global layers (Gemma 3 4B's)."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    model_dir = _rewrite_config(
        gemma3_dir, tmp_path / "m", final_logit_softcapping=5.0, rope_parameters=rope
    )
    model, arch = load_model(model_dir, "float32")
    assert arch.final_logit_softcapping == 5.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    ids = random_ids(80, VOCAB, 7)
    ours = PagedSeqs(model).step([("a", ids)])[0]
    assert ours.abs().max() < 5.0
    assert_close(ours, hf_logits(model_dir, ids))


def test_transformers4_config_form_matches_hf(gemma3_dir: str, tmp_path) -> None:
    """The keys of configs written by transformers 4 (Gemma 3 270M's config.json): rope_theta,
    rope_local_base_freq and rope_scaling instead of rope_parameters, sliding_window_pattern
    instead of layer_types, tie_word_embeddings left out (its default is True)."""
    model_dir = _rewrite_config(
        gemma3_dir,
        tmp_path / "m",
        drop=("rope_parameters", "layer_types", "tie_word_embeddings"),
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=3,
    )
    model, arch = load_model(model_dir, "float32")
    assert arch.layer_sliding == (True, True, False, True)
    assert (arch.rope_theta, arch.local_rope_theta) == (5e5, 2e4)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.tie_word_embeddings and model.lm_head is None
    ids = random_ids(50, VOCAB, 8)
    assert_close(PagedSeqs(model).step([("a", ids)])[0], hf_logits(model_dir, ids))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "relu"}, "activation"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ],
)
def test_unsupported_gemma3_configs_refused(gemma3_dir: str, tmp_path, changes, message) -> None:
    model_dir = _rewrite_config(gemma3_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir)


# ---- sliding windows the loader refuses ---------------------------------------------------


def test_short_window_still_refused_without_masking(tiny_model_dir, tmp_path) -> None:
    """Mistral and Qwen2 do not apply their window: a window shorter than the max length is
    refused for them as before; Gemma 3 loads with its window of 16 at any max length."""
    mistral = _rewrite_config(tiny_model_dir("mistral"), tmp_path / "mistral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(mistral)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(mistral, max_model_len=65)
    load_model(mistral, max_model_len=64)
    qwen2 = _rewrite_config(
        tiny_model_dir("qwen2"),
        tmp_path / "qwen2",
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(qwen2)


def test_gemma3_loads_past_its_window(gemma3_dir: str) -> None:
    model, arch = load_model(gemma3_dir, "float32", max_model_len=512)
    assert arch.sliding_window == WINDOW
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [WINDOW, WINDOW, None, WINDOW]


# ---- greedy generation through the engine vs transformers' generate() ---------------------


def make_prompts() -> tuple[list[list[int]], list[int]]:
    """Prompts of 1..90 tokens, the last three sharing a 60-token prefix (prefix caching has
    something to reuse), and their max_tokens: every sequence ends well past the window."""
    rng = random.Random(4321)
    base = [rng.randrange(5, VOCAB) for _ in range(60)]
    prompts = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (1, 12, 16, 17, 45)]
    prompts += [
        base[:n] + [rng.randrange(5, VOCAB) for _ in range(k)]
        for n, k in ((40, 5), (60, 30), (60, 3))
    ]
    max_tokens = [30 + 3 * i for i in range(len(prompts))]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(gemma3_dir: str) -> list[list[int]]:
    """transformers' greedy outputs (eos suppressed until max_tokens) for make_prompts()."""
    prompts, max_tokens = make_prompts()
    hf = hf_model(gemma3_dir)
    outputs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens, strict=True):
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            outputs.append(out[0, len(ids) :].tolist())
    assert sum(len(set(o)) for o in outputs) > 3 * len(outputs), "greedy output too uniform"
    return outputs


COMBOS = [
    (cache, budget, block_size, "cpu_kernels")
    for cache, budget, block_size in itertools.product([True, False], [24, 2048], [16, 32])
] + [(True, 24, 16, "torch_ops"), (False, 2048, 32, "torch_ops")]


@pytest.mark.parametrize(
    "prefix_caching,budget,block_size,kernels",
    COMBOS,
    ids=[f"cache={c}-budget={b}-bs={s}-{k}" for c, b, s, k in COMBOS],
)
def test_greedy_matches_transformers(
    gemma3_dir, reference, monkeypatch, prefix_caching, budget, block_size, kernels
) -> None:
    """budget 24: prefills in chunks of at most 24 tokens, each after the first attending to
    cached context longer than the window. cpu_kernels: decodes on the compiled windowed
    kernel; torch_ops: on the torch path (the runner built without the CPU kernels)."""
    if kernels == "torch_ops":
        monkeypatch.setattr(model_runner, "cpu_ops", lambda: None)
    prompts, max_tokens = make_prompts()
    llm = LLM(
        model=gemma3_dir,
        dtype="float32",
        block_size=block_size,
        num_blocks=64,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=16,
        attention_backend="torch" if kernels == "torch_ops" else "cpu",
    )
    assert llm.engine.runner.attention.name == ("torch" if kernels == "torch_ops" else "cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outputs, reference, strict=True)):
        assert out.outputs[0].token_ids == expected, f"prompt {i} ({len(prompts[i])} tokens)"
    if prefix_caching:
        again = llm.generate(prompts[5:], params[5:], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == reference[5:]
        assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv.num_free_blocks == 64 - 1
