"""A rolling update of `pdserve serve` under a steady request rate: --model is a symlink; it is
pointed at new weights and serve gets SIGHUP, so every node in turn drains and starts again on
the new weights (1 prefill + 2 decode nodes). Zero requests fail; every response names the
version that produced it (system_fingerprint) and equals that version's offline output, token
for token, so none mixed the tiers of two versions; the gateway counts completions per
version."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pdserve.common.node import checkpoint_fingerprint
from pdserve.engine import LLM, SamplingParams
from pdserve.make_model import make_model
from tests.integration.stack import BLOCK, start_stack

TIMEOUT_S = 120.0
MAX_TOKENS = 8


def point(link: str, target: str) -> None:
    """Atomically make link point at target."""
    tmp = f"{link}.tmp"
    os.symlink(target, tmp)
    os.replace(tmp, link)


@pytest.fixture(scope="module")
def versions(tiny_llama, tmp_path_factory) -> dict[str, str]:
    v2 = str(tmp_path_factory.mktemp("v2"))
    make_model("llama", "tiny", v2, seed=1)  # same tokenizer, other weights
    return {checkpoint_fingerprint(tiny_llama): tiny_llama, checkpoint_fingerprint(v2): v2}


def test_rolling_update_under_load_drops_nothing_and_mixes_no_versions(
    versions, tmp_path_factory
) -> None:
    (v1, v1_dir), (v2, v2_dir) = versions.items()
    assert v1 != v2
    work = tmp_path_factory.mktemp("rolling")
    link = str(work / "current")
    point(link, v1_dir)
    extra = ["--roll-drain-timeout-s", "30"]
    stack = start_stack(link, work, num_prefill=1, num_decode=2, extra=extra)
    results: list[tuple[list[int], list[int], str]] = []
    errors: list[str] = []
    stop = threading.Event()
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)
    model = client.models.list().data[0].id

    def one(seed: int) -> None:
        rng = random.Random(seed)
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(20, 40))]
        try:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            tokens = out.choices[0].token_ids  # type: ignore[attr-defined]
            results.append((prompt, tokens, out.system_fingerprint or ""))
        except Exception as e:  # every failure counts; the test asserts there are none
            errors.append(repr(e))

    def load() -> None:  # ~8 requests a second, 4 at a time
        with ThreadPoolExecutor(4) as pool:
            seed = 0
            while not stop.is_set():
                pool.submit(one, seed)
                seed += 1
                time.sleep(0.125)

    loader = threading.Thread(target=load)
    try:
        loader.start()
        time.sleep(2.0)
        point(link, v2_dir)
        os.kill(stack.proc.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 150
        while {name: _version(stack, name) for name in stack.nodes if name != "gateway"} != {
            name: v2 for name in stack.nodes if name != "gateway"
        }:
            assert time.monotonic() < deadline, f"the roll did not finish:\n{stack.proc.log()}"
            assert stack.proc.alive(), stack.proc.log()
            time.sleep(0.5)
        time.sleep(2.0)  # the new version under load too
    finally:
        stop.set()
        loader.join(TIMEOUT_S)
        text = urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10).read().decode()
        code = stack.proc.stop(timeout_s=40)
    assert code == 0, stack.proc.log()
    assert not errors, errors[:5]
    seen = {fingerprint for _, _, fingerprint in results}
    assert seen == {f"fp_{v1}", f"fp_{v2}"}, seen
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for version, directory in versions.items():
        mine = [(p, t) for p, t, f in results if f == f"fp_{version}"]
        offline = LLM(model=directory, dtype="float32", block_size=BLOCK, num_blocks=256)
        want = offline.generate([p for p, _ in mine], params, use_tqdm=False)
        for (prompt, got), w in zip(mine, want, strict=True):
            assert got == w.outputs[0].token_ids, f"version {version}, prompt {prompt[:4]}..."
    for version in versions:
        assert f'model_version="{version}"' in text


def _version(stack, name: str) -> str | None:
    try:
        return stack.load(name).model_version
    except grpc.RpcError:
        return None  # restarting
