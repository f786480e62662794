"""Our Llama-family model over the paged KV cache vs transformers, logit for logit (fp32).

The model runs through engine.attention.paged_attention with hand-built AttentionMetadata, so
these tests check the attention paths too: one-shot prefill, chunked prefill over cached
context, and batched decode.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSeq,
    TorchAttention,
)
from pdserve.engine.models import llama
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.loader import load_model, parse_model_arch
from pdserve.engine.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BLOCK_SIZE = 16
ATOL = 1e-4

torch.set_num_threads(2)


class PagedSeqs:
    """A minimal scheduler + model runner: per-sequence block tables over one KV cache per
    layer, blocks handed out in order from 1 (block 0 is the null block)."""

    attention: AttentionBackend = TorchAttention()
    """The attention backend its steps' metadata names (conftest's layer_kernels sets it)."""
    fused_ops: ModuleType | None = None
    """The compiled layers its model runs on (conftest's layer_kernels sets them)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64) -> None:
        shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
        self.model = model
        model.use_cpu_fused_ops(self.fused_ops)
        self.kv_caches = [
            torch.zeros(shape, dtype=model.dtype) for _ in range(model.arch.num_layers)
        ]
        self.next_block = 1
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def _slots(self, seq: str, n: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        self.lens[seq] = start + n
        while len(table) * BLOCK_SIZE < start + n:
            table.append(self.next_block)
            self.next_block += 1
        return [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)
        ]

    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one step; entries with one token are decodes and must come first. Returns the
        logits [n_i, vocab] of each entry's tokens."""
        num_decodes = sum(len(toks) == 1 for _, toks in batch)
        assert all(len(toks) == 1 for _, toks in batch[:num_decodes]), "decodes go first"
        ids, positions, slots, prefills = [], [], [], []
        for seq, toks in batch:
            start = self.lens.get(seq, 0)
            slots += self._slots(seq, len(toks))
            if len(toks) > 1:
                prefills.append(
                    PrefillSeq(
                        query_start=len(ids),
                        query_len=len(toks),
                        context_len=self.lens[seq],
                        block_table=torch.tensor(self.tables[seq], dtype=torch.int64),
                    )
                )
            ids += toks
            positions += range(start, start + len(toks))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=num_decodes,
            prefills=prefills,
            block_size=BLOCK_SIZE,
            backend=self.attention,
            **self._decode_meta([seq for seq, _ in batch[:num_decodes]]),
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                self.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(toks) for _, toks in batch]))

    def _decode_meta(self, seqs: list[str]) -> dict[str, torch.Tensor | None]:
        max_blocks = max((len(self.tables[s]) for s in seqs), default=1)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
        for i, seq in enumerate(seqs):
            tables[i, : len(self.tables[seq])] = torch.tensor(self.tables[seq])
        seq_lens = torch.tensor([self.lens[s] for s in seqs], dtype=torch.int64)
        mask = torch.arange(max_blocks * BLOCK_SIZE)[None, :] < seq_lens[:, None]
        return {
            "decode_block_tables": tables,
            "decode_seq_lens": seq_lens,
            "decode_mask": mask[:, None, None, :] if seqs else None,
        }


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), vocab] for one sequence."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return _HF_CACHE[model_dir](torch.tensor([ids])).logits[0].float()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=gen).tolist()  # ids 0..4 are special


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Callable[[str], str]) -> Callable[[str], tuple[str, LlamaForCausalLM]]:
    cache: dict[str, tuple[str, LlamaForCausalLM]] = {}

    def get(arch: str) -> tuple[str, LlamaForCausalLM]:
        if arch not in cache:
            model_dir = tiny_model_dir(arch)
            cache[arch] = (model_dir, load_model(model_dir, "float32")[0])
        return cache[arch]

    return get


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs logit diff {diff:.3g} > {atol}"


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_hf(arch: str, loaded: Callable, layer_kernels: str) -> None:
    model_dir, model = loaded(arch)
    prompts = {f"p{n}": random_ids(n, 2000, seed=n) for n in (1, 7, 33, 300)}
    runner = PagedSeqs(model)
    # The 1-token prompt takes the decode path; the others are batched prefills.
    logits = runner.step(list(prompts.items()))
    for ids, ours in zip(prompts.values(), logits, strict=True):
        assert ours.dtype == torch.float32 and ours.shape == (len(ids), model.arch.vocab_size)
        assert_close(ours, hf_logits(model_dir, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_batched_decode_match_hf(
    arch: str, loaded: Callable, layer_kernels: str
) -> None:
    model_dir, model = loaded(arch)
    a, b, c = random_ids(40, 2000, 1), random_ids(21, 2000, 2), random_ids(3, 2000, 3)
    runner = PagedSeqs(model)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    # Step 1: first chunk of a (not block-aligned), all of b. Step 2: rest of a (attends to
    # the cached first chunk) batched with all of c.
    la, lb = runner.step([("a", a[:25]), ("b", b)])
    got["a"].append(la), got["b"].append(lb)
    la, lc = runner.step([("a", a[25:]), ("c", c)])
    got["a"].append(la), got["c"].append(lc)
    seqs = {"a": list(a), "b": list(b), "c": list(c)}
    for _ in range(6):  # greedy decode, three requests batched, crossing block boundaries
        batch = [(s, [int(got[s][-1][-1].argmax())]) for s in seqs]
        for (s, tok), out in zip(batch, runner.step(batch), strict=True):
            seqs[s] += tok
            got[s].append(out)
    for s, ids in seqs.items():
        ours = torch.cat(got[s])[: len(ids)]
        assert_close(ours, hf_logits(model_dir, ids))


def test_bfloat16_smoke(tiny_llama: str) -> None:
    model, _ = load_model(tiny_llama, "bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = random_ids(50, 2000, 5)
    ours = PagedSeqs(model).step([("a", ids)])[0]
    ref = hf_logits(tiny_llama, ids)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_sharded_checkpoint_loads_the_same(tiny_llama: str, tmp_path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for shard, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{shard + 1}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    single, _ = load_model(tiny_llama, "float32")
    split, _ = load_model(str(sharded), "float32")
    for (name, p1), (_, p2) in zip(
        single.state_dict().items(), split.state_dict().items(), strict=True
    ):
        assert torch.equal(p1, p2), name


def test_tied_embeddings(tiny_qwen2: str) -> None:
    model, arch = load_model(tiny_qwen2)
    assert arch.tie_word_embeddings and model.lm_head is None
    assert "lm_head.weight" not in load_file(os.path.join(tiny_qwen2, "model.safetensors"))
    hidden = torch.randn(3, arch.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    assert torch.allclose(model.compute_logits(hidden), expected)


def _rewrite_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_rope_linear_scaling_matches_hf(tiny_llama: str, tmp_path) -> None:
    model_dir = _rewrite_config(
        tiny_llama, tmp_path / "linear", rope_scaling={"rope_type": "linear", "factor": 2.5}
    )
    model, arch = load_model(model_dir, "float32")
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.5}
    ids = random_ids(300, 2000, 7)
    assert_close(PagedSeqs(model).step([("a", ids)])[0], hf_logits(model_dir, ids))


def test_rope_llama3_scaling_parsed(tiny_llama: str) -> None:
    # The tiny llama itself uses llama3 scaling (checked against HF above); make sure it is on.
    scaling = parse_model_arch(tiny_llama).rope_scaling
    assert scaling is not None and scaling["rope_type"] == "llama3"
    assert parse_model_arch(tiny_llama).max_position_embeddings >= 1024


def test_hf_saved_llama_variant_matches(tmp_path) -> None:
    """A checkpoint written by transformers 5 itself (rope_parameters, dtype keys): MQA, a
    head_dim apart from hidden/heads, q/k/v/o and MLP biases, tied embeddings, linear RoPE."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    )
    torch.manual_seed(0)
    hf = HFLlama(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases start at zero otherwise
    hf.save_pretrained(tmp_path)
    model, arch = load_model(str(tmp_path), "float32")
    assert (arch.num_kv_heads, arch.head_dim, arch.rope_theta) == (1, 32, 5000.0)
    assert arch.o_proj_bias and arch.mlp_bias and arch.tie_word_embeddings
    ids = random_ids(70, 300, 8)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(PagedSeqs(model).step([("a", ids)])[0], ref)


# ---- loader errors -------------------------------------------------------------------------


def test_error_missing_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_error_missing_config(tmp_path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_error_no_weights(tiny_llama: str, tmp_path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="no .*safetensors"):
        load_model(str(model_dir))


def test_error_missing_and_misshapen_weight(tiny_llama: str, tmp_path) -> None:
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    path = str(model_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, path)
    with pytest.raises(ValueError, match=r"incomplete checkpoint.*layers\.1\.mlp\.up_proj"):
        load_model(str(model_dir))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        load_model(str(model_dir))


def test_error_unsupported_architecture(tiny_llama: str, tmp_path) -> None:
    model_dir = _rewrite_config(tiny_llama, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(model_dir)
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    }
    with pytest.raises(ValueError, match="supported"):
        get_model_class("Nope")


def test_sliding_window(tiny_mistral: str, tmp_path) -> None:
    model_dir = _rewrite_config(tiny_mistral, tmp_path / "m", sliding_window=256)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(model_dir)
    load_model(model_dir, max_model_len=256)  # the window never comes into play
    assert parse_model_arch(tiny_mistral).sliding_window is None


def test_float16_checkpoint_auto_is_bfloat16(tiny_llama: str, tmp_path) -> None:
    model_dir = _rewrite_config(tiny_llama, tmp_path / "m", torch_dtype="float16")
    model, arch = load_model(model_dir)
    assert arch.torch_dtype == torch.float16
    assert model.model.norm.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model(model_dir, "float16")


def test_padded_rows_buckets() -> None:
    sizes = {llama.padded_rows(n) for n in range(1, 4097)}
    assert len(sizes) <= 96, "few distinct GEMM shapes"
    for n in range(1, 4097):
        rows = llama.padded_rows(n)
        assert n <= rows < n * 1.125 + 1, (n, rows)
        assert llama.padded_rows(rows) == rows


def test_padding_rows_change_nothing(loaded: Callable, monkeypatch) -> None:
    """The same step with and without padding rows: equal logits, equal K/V, and the padding
    rows write nothing (the null block stays zero)."""
    _, model = loaded("qwen3")
    prompts = [("a", random_ids(3, 2000, 7)), ("b", random_ids(30, 2000, 8))]  # 33 -> 36 rows
    assert llama.padded_rows(33) == 36
    monkeypatch.setattr(llama, "PADDED_DTYPES", {torch.float32, torch.bfloat16})
    padded = PagedSeqs(model)
    got_padded = padded.step(prompts)
    monkeypatch.setattr(llama, "padded_rows", lambda n: n)
    plain = PagedSeqs(model)
    got_plain = plain.step(prompts)
    for a, b in zip(got_padded, got_plain, strict=True):
        assert_close(a, b, atol=1e-5)
    for cache_p, cache_u in zip(padded.kv_caches, plain.kv_caches, strict=True):
        assert not cache_p[0].any(), "padding rows must not write into the null block"
        torch.testing.assert_close(cache_p, cache_u, atol=1e-5, rtol=1e-5)


def test_only_bf16_cpu_forwards_pad_rows() -> None:
    rows = torch.zeros(33, 4)
    assert llama._pad_rows(rows, torch.bfloat16).shape == (36, 4)
    assert not llama._pad_rows(rows, torch.bfloat16)[33:].any()
    assert llama._pad_rows(rows, torch.float32) is rows
