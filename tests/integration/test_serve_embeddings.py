"""/v1/embeddings through `pdserve serve` (1 prefill + 1 decode node) with the official openai
client: the vectors equal the offline engine's (and so transformers', tests/engine/
test_embeddings.py), float and base64, single and batched, strings and token ids; bad input is
a 400 and the stack keeps serving."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from pdserve.engine import LLM
from tests.integration.stack import BLOCK, start_stack


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("serve_embed"), 1, 1)
    try:
        yield s
    finally:
        code = s.proc.stop(timeout_s=40)
        assert code == 0, f"pdserve serve exited with {code}:\n{s.proc.log()}"


def test_embeddings_equal_the_offline_engine(stack, tiny_llama):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
    offline = LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=128)
    texts = ["The capital of France is", "def fibonacci(n):", "a"]
    want = [o.outputs.embedding for o in offline.embed(texts)]
    reply = client.embeddings.create(model=stack.model, input=texts)
    assert [d.index for d in reply.data] == [0, 1, 2]
    for got, expected in zip(reply.data, want, strict=True):
        np.testing.assert_allclose(got.embedding, expected, atol=1e-5)
        assert abs(np.linalg.norm(got.embedding) - 1) < 1e-4
    tokens = offline.get_tokenizer().encode(texts[0])
    assert reply.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(t)) for t in texts)
    by_ids = client.embeddings.create(model=stack.model, input=tokens, encoding_format="base64")
    raw = by_ids.data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4") if isinstance(raw, str) else raw
    np.testing.assert_allclose(vector, want[0], atol=1e-5)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=stack.model, input=[[1, 10**8]])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=stack.model, input="hi", dimensions=3)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=stack.model, input=[])
    again = client.embeddings.create(model=stack.model, input=texts[1])
    np.testing.assert_allclose(again.data[0].embedding, want[1], atol=1e-5)
    stack.wait_all_blocks_free()
