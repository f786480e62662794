"""The draft-model proposer: vocabulary check, proposals, its own KV blocks and counters."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.draft_model import DraftModelProposer

PROMPT = list(range(300, 320))


@pytest.fixture(scope="module")
def greedy_continuation(tiny_llama: str) -> list[int]:
    llm = LLM(model=tiny_llama, dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def proposer(model_dir: str, num_blocks: int = 64) -> DraftModelProposer:
    return DraftModelProposer(
        model_dir,
        "float32",
        vocab_size=2048,
        max_model_len=2048,
        num_blocks=num_blocks,
        block_size=4,
    )


def decoding(outputs: list[int], rid: str = "a") -> Request:
    r = Request(rid, list(PROMPT), SamplingParams(temperature=0.0, max_tokens=50))
    r.output_token_ids = list(outputs)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_vocabulary_must_match(tiny_llama: str, tmp_path) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(tiny_llama, draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] = 4096
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size 4096, the target 2048"):
        proposer(str(draft))


def test_draft_equal_to_target_proposes_the_greedy_continuation(
    tiny_llama: str, greedy_continuation: list[int]
) -> None:
    g = greedy_continuation
    p = proposer(tiny_llama)
    r = decoding(g[:1])  # 21 tokens, the last (g0) at position 20
    assert p.propose([(r, 3)])["a"].token_ids == g[1:4]
    # catch-up of all 21 tokens, then g1, g2 computed: positions 0..22 -> 6 blocks of 4
    assert p.num_computed["a"] == 23 and p.kv.get_block_ids("a") == [1, 2, 3, 4, 5, 6]
    # the target accepted g1 and emitted g2: KV of g2 (position 22) is stale
    p.rollback("a", 21 + 1)
    assert p.num_computed["a"] == 22 and len(p.kv.get_block_ids("a")) == 6
    r.output_token_ids = g[:3]
    proposal = p.propose([(r, 2)])["a"]
    assert proposal.token_ids == g[3:5] and tuple(proposal.probs.shape) == (2, 2048)
    assert proposal.probs.sum(dim=-1).tolist() == [1.0, 1.0]  # greedy: one-hot q
    # rejected at once: back to the 23 tokens the step started with; trailing block freed
    p.rollback("a", 23)
    r.output_token_ids = g[:4]
    assert p.num_computed["a"] == 23 and len(p.kv.get_block_ids("a")) == 6
    assert p.propose([(r, 3)])["a"].token_ids == g[4:7]
    p.free("a")
    assert p.kv.num_free_blocks == 63 and "a" not in p.num_computed


def test_full_draft_cache_proposes_nothing_for_that_request(tiny_llama: str) -> None:
    p = proposer(tiny_llama, num_blocks=8)  # 7 blocks of 4: 28 positions
    long = decoding([5] * 8, "long")  # 28 tokens + 2 drafts: 30 positions
    short = decoding([], "short")
    short.prompt_token_ids = PROMPT[:5]
    short.output_token_ids = [6]
    short.num_computed_tokens = 5
    proposals = p.propose([(long, 3), (short, 3)])
    assert list(proposals) == ["short"] and "long" not in p.num_computed
    assert p.kv.get_block_ids("long") == [] and p.kv.num_free_blocks == 5
