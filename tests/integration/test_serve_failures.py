"""Killing nodes under load: a dead prefill node's requests finish elsewhere, a dead decode
node's requests end (resubmitted or with a clear error) within a deadline — never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.integration.stack import BLOCK, start_stack
from tests.integration.test_serve import grpc_generate, mixed_workload

DEADLINE_S = 90.0


@pytest.fixture
def stack(tiny_llama, tmp_path):
    s = start_stack(tiny_llama, tmp_path)
    try:
        yield s
    finally:
        s.proc.stop(timeout_s=40)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=512)


def test_killing_a_prefill_node_mid_run_loses_no_request(stack, offline):
    work = [(p, sp) for p, sp in mixed_workload(24, seed=7) if len(p) >= 20]
    victim = stack.nodes["prefill-0"]["pid"]
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [
            pool.submit(grpc_generate, stack.grpc_address, stack.model, p, sp) for p, sp in work
        ]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        served = [f.result(timeout=DEADLINE_S) for f in futures]
    for (prompt, params), (ids, _) in zip(work, served, strict=True):
        want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert ids[0] == want.token_ids
    stack.wait_all_blocks_free(skip=("prefill-0",))


def test_killing_a_decode_node_ends_its_requests_within_a_deadline(stack, offline):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=DEADLINE_S)
    prompts = [p for p, _ in mixed_workload(12, seed=9)]
    greedy = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    wants = {
        tuple(p): o.outputs[0].text
        for p, o in zip(prompts, offline.generate(prompts, greedy, use_tqdm=False), strict=True)
    }
    outcomes: list[str] = []
    lock = threading.Lock()
    first_tokens = threading.Semaphore(0)

    def one(prompt):
        try:
            stream = client.completions.create(
                model=stack.model,
                prompt=prompt,
                max_tokens=150,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
            )
            it = iter(stream)
            text = "".join(c.choices[0].text for c in [next(it)] if c.choices)
            first_tokens.release()
            text += "".join(c.choices[0].text for c in it if c.choices)
            # resubmitted to the surviving node, greedy output continues exactly
            want = wants[tuple(prompt)]
            outcome = "ok" if text == want else f"wrong text: {text!r} != {want!r}"
        except openai.APIError as e:
            first_tokens.release()
            outcome = f"error: {e}"
            assert str(e)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    start = time.monotonic()
    for t in threads:
        t.start()
    for _ in prompts:  # every request is streaming (or failed) before the kill
        assert first_tokens.acquire(timeout=DEADLINE_S)
    os.kill(stack.nodes["decode-0"]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a request hung after its decode node died"
    assert len(outcomes) == len(prompts) and time.monotonic() - start < DEADLINE_S
    # each request either continued exactly on the other node or ended with a clear error
    assert all(o == "ok" or o.startswith("error: ") for o in outcomes), outcomes
    # the stack keeps serving through the surviving decode node
    p = SamplingParams(max_tokens=6, temperature=0.0)
    ids, _ = grpc_generate(stack.grpc_address, stack.model, prompts[0], p)
    assert ids[0] == offline.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    stack.wait_all_blocks_free(skip=("decode-0",))
