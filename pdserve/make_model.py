"""Write a small random Hugging Face-format model + tokenizer (``pdserve make-model``).

Output directories load with transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer`` and with
our own loader. Everything is deterministic: the tokenizer is a byte-level BPE trained on a
fixed, sorted slice of this Python's standard library, the weights come from a seeded generator,
so the same (arch, preset, seed, device) gives byte-identical files on one machine. The weights
are drawn on the device asked for (`--device cuda` makes a 1B-parameter preset in seconds); a
CUDA generator draws other numbers than the CPU's for the same seed.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.engine.utils import cdiv

logger = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PRESETS = ("tiny", "small", "bench")
"""Sizes for tests and demos on a CPU."""
GPU_PRESETS = ("gpu-1b",)
"""Sizes for a GPU: gpu-1b is a Llama shape of 0.85B parameters, under every arch's rules
(qwen2's tied embeddings: 0.79B; qwen3's doubled head_dim: 1.02B)."""

BOS, EOT, IM_START, IM_END, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
)
SPECIAL_TOKENS = (BOS, EOT, IM_START, IM_END, PAD)  # ids 0..4, in this order
_CORPUS_CAP_CHARS = 2_000_000

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_HF_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
}


@dataclass(frozen=True)
class Preset:
    """Sizes of one preset."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tokenizer_vocab: int
    """Vocabulary the tokenizer is trained to (at most: the corpus allows ~27.7k)."""
    max_position_embeddings: int
    vocab_size: int = 0
    """The model's vocabulary when larger than the tokenizer's (real models pad theirs too; the
    ids past the tokenizer's decode to nothing); 0: the tokenizer's, rounded up to 64."""


PRESET_SIZES = {
    "tiny": Preset(256, 4, 4, 2, 688, 2048, 2048),
    "small": Preset(512, 8, 8, 4, 1408, 8192, 4096),
    "bench": Preset(768, 16, 12, 4, 2048, 8192, 4096),
    "gpu-1b": Preset(2048, 16, 32, 8, 5632, 32000, 4096, vocab_size=32000),
}


def _check(arch: str, preset: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if preset not in PRESET_SIZES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS + GPU_PRESETS}")


def make_config(arch: str, preset: str, tokenizer_size: int | None = None) -> dict[str, Any]:
    """config.json contents for (arch, preset); vocab_size covers tokenizer_size (rounded up
    to a multiple of 64), defaulting to the preset's tokenizer vocabulary."""
    _check(arch, preset)
    p = PRESET_SIZES[preset]
    vocab = max(cdiv(tokenizer_size or p.tokenizer_vocab, 64) * 64, p.vocab_size)
    model_type, architecture = _HF_NAMES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.hidden_size // p.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-5 if arch in ("llama", "mistral") else 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": arch == "qwen2",  # like Qwen2-0.5B
        "bos_token_id": SPECIAL_TOKENS.index(BOS if arch in ("llama", "mistral") else EOT),
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    config.update(_ARCH_EXTRAS[arch](p))
    return config


def _llama_extras(p: Preset) -> dict[str, Any]:
    # llama3 RoPE scaling with a short original context so that all three frequency bands
    # (kept, interpolated, divided) occur within the head dimension.
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": p.max_position_embeddings // 8,
    }
    return {"rope_scaling": rope, "attention_bias": False, "mlp_bias": False}


def _qwen2_extras(p: Preset) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": p.num_layers}


def _qwen3_extras(p: Preset) -> dict[str, Any]:
    # Qwen3-style explicit head_dim, twice hidden_size / num_heads.
    return {
        **_qwen2_extras(p),
        "head_dim": 2 * p.hidden_size // p.num_heads,
        "attention_bias": False,
    }


def _mistral_extras(p: Preset) -> dict[str, Any]:
    return {"sliding_window": None}


_ARCH_EXTRAS = {
    "llama": _llama_extras,
    "qwen2": _qwen2_extras,
    "qwen3": _qwen3_extras,
    "mistral": _mistral_extras,
}


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor name -> shape for a config made by make_config."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    qkv_bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        for proj, heads in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
            shapes[pre + f"self_attn.{proj}.weight"] = (heads * d, h)
            if qkv_bias:
                shapes[pre + f"self_attn.{proj}.bias"] = (heads * d,)
        shapes[pre + "self_attn.o_proj.weight"] = (h, nh * d)
        if config["model_type"] == "qwen3":
            shapes[pre + "self_attn.q_norm.weight"] = (d,)
            shapes[pre + "self_attn.k_norm.weight"] = (d,)
        shapes[pre + "mlp.gate_proj.weight"] = (inter, h)
        shapes[pre + "mlp.up_proj.weight"] = (inter, h)
        shapes[pre + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def param_count(arch: str, preset: str) -> int:
    """Parameters of (arch, preset), computed from the config without building weights."""
    return sum(_numel(s) for s in weight_shapes(make_config(arch, preset)).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _init_std(name: str, config: dict[str, Any]) -> float | None:
    """Std of a weight's normal init; None for norm weights. Tuned so that greedy output of
    the random model varies instead of settling on one token: untied embeddings are large
    (tokens stay distinguishable through the layers), tied ones small (otherwise each token
    predicts itself), and q/k larger than 0.02 so that attention is not uniform."""
    if name.endswith("norm.weight"):
        return None
    if "embed_tokens" in name:
        return 0.05 if config["tie_word_embeddings"] else 1.0
    if "q_proj.weight" in name or "k_proj.weight" in name:
        return 0.15
    return 0.02


def make_weights(
    config: dict[str, Any], seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights for config, in a fixed order (deterministic per device),
    drawn on device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        std = _init_std(name, config)
        if std is not None:
            weights[name] = std * torch.randn(shape, generator=gen, device=device)
            continue
        # Norm weights 1 + noise (so a loader that skips them is caught). The final norm gets
        # random signs: with tied embeddings this removes the bias of a token towards itself.
        weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        if name == "model.norm.weight":
            signs = torch.randint(0, 2, shape, generator=gen, device=device) * 2 - 1
            weights[name] *= signs
    return weights


def _corpus(cap_chars: int = _CORPUS_CAP_CHARS) -> list[str]:
    """A fixed slice of the stdlib's top-level .py files, in sorted order, up to cap_chars."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        total += len(texts[-1])
        if total >= cap_chars:
            break
    return texts


# Qwen2's pre-tokenizer split; transformers' Qwen2Tokenizer rebuilds its pipeline with it
# (ignoring tokenizer.json's), so every arch uses it for both to agree.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE (tokenizer.json text, no post-processor) with SPECIAL_TOKENS at ids
    0..4, trained on a fixed slice of the stdlib."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def make_tokenizer_json(arch: str, vocab_size: int) -> str:
    """tokenizer.json for arch: Llama/Mistral prepend bos in the post-processor (where
    transformers 5 and the tokenizers library both read it), Qwen adds nothing."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(train_tokenizer(vocab_size))
    if arch in ("llama", "mistral"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def _tokenizer_files(arch: str, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json contents."""
    llama_like = arch in ("llama", "mistral")
    special = {"bos_token": BOS if llama_like else None, "eos_token": IM_END, "pad_token": PAD}
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    bos_prefix = "{{ bos_token }}" if llama_like else ""
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "add_bos_token": llama_like,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": bos_prefix + CHATML_TEMPLATE,
        "added_tokens_decoder": added,
    }
    special_map = {k: v for k, v in special.items() if v is not None}
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_map}


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def make_model(
    arch: str, preset: str, out: str, seed: int = 0, device: str | torch.device = "cpu"
) -> None:
    """Write a random (arch, preset) model + tokenizer in Hugging Face format to out, the
    weights drawn on device."""
    _check(arch, preset)
    tokenizer_json = make_tokenizer_json(arch, PRESET_SIZES[preset].tokenizer_vocab)
    tokenizer_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    config = make_config(arch, preset, tokenizer_size)
    os.makedirs(out, exist_ok=True)
    _write_json(os.path.join(out, "config.json"), config)
    _write_json(
        os.path.join(out, "generation_config.json"),
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOT)],
            "pad_token_id": config["pad_token_id"],
        },
    )
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    for name, obj in _tokenizer_files(arch, config).items():
        _write_json(os.path.join(out, name), obj)
    weights = {name: w.cpu() for name, w in make_weights(config, seed, device).items()}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    logger.info(
        "wrote %s/%s model (%.1fM params, vocab %d, seed %d) to %s",
        arch,
        preset,
        sum(w.numel() for w in weights.values()) / 1e6,
        config["vocab_size"],
        seed,
        out,
    )
