"""The real SmolLM2-135M-Instruct GGUF served by the whole stack (1 prefill + 1 decode node, the
prompt prefilled remotely and its KV pushed over the wire), asked a factual question through the
official openai client."""

from __future__ import annotations

import openai
import pytest

from tests.integration.stack import SMOLLM2_NAMES
from tests.observability.scrape import Samples, scrape

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


MODEL = SMOLLM2_NAMES[0]


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack


def test_a_served_chat_answers_stops_at_the_end_of_turn_and_streams_the_same(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=64, temperature=0
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content
    assert reply.usage.completion_tokens < 64
    streamed, finish = "", None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=64, temperature=0, stream=True
    ):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert streamed == choice.message.content and finish == "stop"
    decode_load = stack.load("decode-0")
    assert decode_load.num_running == 0


def test_the_prompt_was_computed_on_the_prefill_node(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    prefill = Samples(scrape(stack.nodes["prefill-0"]["metrics_address"]))
    assert prefill.value("pdserve:prompt_tokens_total") >= reply.usage.prompt_tokens
