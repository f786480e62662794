"""pdserve bench serve: metric aggregation (hand-computed), datasets, arrivals, and end-to-end runs
against a fake OpenAI-compatible SSE server with injected delays and failures."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.bench import (
    LoopStalls,
    PromptVocab,
    RequestResult,
    arrival_offsets_s,
    build_payload,
    calculate_metrics,
    is_token_chunk,
    load_vocab,
    parse_goodput,
    sample_prefix_repetition,
    sample_random,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = PromptVocab(allowed_ids=np.arange(5, 1000), decode=lambda ids: " ".join(map(str, ids)))


# -- metric aggregation ---------------------------------------------------------------------------


def _ok(prompt_len: int, out: int | None, ttft: float, itl: list[float], e2e: float, chunks: int):
    return RequestResult(
        prompt_len=prompt_len,
        success=True,
        output_tokens=out,
        num_token_chunks=chunks,
        ttft_s=ttft,
        itl_s=itl,
        latency_s=e2e,
    )


def _results() -> list[RequestResult]:
    return [
        _ok(10, 4, 0.1, [0.02, 0.03, 0.05], 0.2, chunks=4),  # TPOT (0.2 - 0.1) / 3
        _ok(20, 2, 0.3, [0.1], 0.4, chunks=2),  # TPOT 0.1
        _ok(5, None, 0.05, [], 0.05, chunks=1),  # no usage: 1 token chunk -> 1 token, no TPOT
        RequestResult(prompt_len=7, error="HTTP 500: boom"),
    ]


def test_counts_and_throughputs() -> None:
    m = calculate_metrics(_results(), duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (35, 7)
    assert m.output_lens == [4, 2, 1, 0]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    assert m.request_goodput is None


def test_latency_stats_hand_computed() -> None:
    m = calculate_metrics(_results(), duration_s=2.0, percentiles=[50, 99])
    ttft, tpot, itl, e2el = (m.stats[k] for k in ("ttft", "tpot", "itl", "e2el"))
    # TTFT ms [100, 300, 50]: sorted [50, 100, 300]; p99 rank 1.98 -> 100 + 0.98 * 200
    assert (ttft.mean_ms, ttft.median_ms) == pytest.approx((150.0, 100.0))
    assert ttft.percentiles_ms == pytest.approx({50: 100.0, 99: 296.0})
    assert ttft.std_ms == pytest.approx(np.std([100, 300, 50]))
    # TPOT ms [33.33, 100] (the 1-token request has none)
    assert (tpot.mean_ms, tpot.median_ms) == pytest.approx((200 / 3, 200 / 3))
    # ITL ms pooled [20, 30, 50, 100]; p99 rank 2.97 -> 50 + 0.97 * 50
    assert (itl.mean_ms, itl.median_ms) == pytest.approx((50.0, 40.0))
    assert itl.percentiles_ms[99] == pytest.approx(98.5)
    # E2EL ms [200, 400, 50]
    assert (e2el.mean_ms, e2el.median_ms) == pytest.approx((650 / 3, 200.0))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200.0}, 2),  # 100 and 50 ms pass, 300 fails
        ({"tpot": 50.0}, 2),  # 33.3 passes, 100 fails, the 1-token request counts as TPOT 0
        ({"ttft": 200.0, "e2el": 100.0}, 1),  # only the 50 ms request meets both
        ({"e2el": 400.0}, 3),  # the SLO is inclusive
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    m = calculate_metrics(_results(), duration_s=2.0, percentiles=[99], goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_all_failed_gives_zeros() -> None:
    m = calculate_metrics([RequestResult(prompt_len=3, error="x")], 1.0, [50, 99], {"ttft": 1.0})
    assert (m.completed, m.failed, m.total_output, m.request_goodput) == (0, 1, 0, 0.0)
    assert m.stats["itl"].percentiles_ms == {50: 0.0, 99: 0.0}


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


# -- datasets and arrivals ------------------------------------------------------------------------


def test_loop_stalls_measure_a_blocked_client() -> None:
    """A loop blocked for 200 ms (what a client that is not scheduled looks like) shows up as
    a stall of about that size; the loop's ordinary wake-ups do not count as one."""

    async def run() -> LoopStalls:
        stalls = LoopStalls()
        async with stalls.watching():
            await asyncio.sleep(0.1)
            time.sleep(0.2)  # the whole loop stands still
            await asyncio.sleep(0.1)
        return stalls

    stalls = asyncio.run(run())
    summary = stalls.summary()
    assert 190 <= summary["client_stall_max_ms"] < 1000
    assert 0.19 <= summary["client_stall_over_warn_s"] < 1.0
    assert sorted(stalls.late_s)[len(stalls.late_s) // 2] < 0.1  # the rest woke about on time
    assert LoopStalls().summary()["client_stall_max_ms"] == 0.0  # never watched: no stall


def test_random_lengths_within_range_ratio() -> None:
    reqs = sample_random(VOCAB, 200, input_len=100, output_len=10, range_ratio=0.25, seed=1)
    in_lens = [len(r.prompt_ids) for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 75 and max(in_lens) <= 125 and len(set(in_lens)) > 10
    assert min(out_lens) >= 7 and max(out_lens) <= 13  # [floor(7.5), ceil(12.5)]
    assert all(5 <= t < 1000 for r in reqs for t in r.prompt_ids)


def test_random_fixed_lengths_and_shared_prefix() -> None:
    reqs = sample_random(VOCAB, 8, input_len=32, output_len=4, prefix_len=16, seed=0)
    assert {len(r.prompt_ids) for r in reqs} == {48}
    assert {r.output_len for r in reqs} == {4}
    assert len({tuple(r.prompt_ids[:16]) for r in reqs}) == 1
    assert len({tuple(r.prompt_ids[16:]) for r in reqs}) == 8


def test_prefix_repetition_shares_prefixes() -> None:
    reqs = sample_prefix_repetition(VOCAB, 12, 8, 4, num_prefixes=3, output_len=5, seed=0)
    assert len(reqs) == 12 and {len(r.prompt_ids) for r in reqs} == {12}
    groups: dict[tuple[int, ...], int] = {}
    for r in reqs:
        groups[tuple(r.prompt_ids[:8])] = groups.get(tuple(r.prompt_ids[:8]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    assert {r.output_len for r in reqs} == {5}


def test_datasets_deterministic_by_seed() -> None:
    def ids(seed: int) -> list[list[int]]:
        a = sample_random(VOCAB, 5, 20, 4, range_ratio=0.5, prefix_len=3, seed=seed)
        b = sample_prefix_repetition(VOCAB, 6, 4, 4, 2, 3, seed=seed)
        return [r.prompt_ids for r in a + b] + [[r.output_len for r in a]]

    assert ids(7) == ids(7)
    assert ids(7) != ids(8)


def test_load_vocab_excludes_special_tokens(tiny_llama: str) -> None:
    vocab = load_vocab(tiny_llama)
    assert not {0, 1, 2, 3, 4} & set(vocab.allowed_ids.tolist())  # tiny llama's special ids
    assert isinstance(vocab.decode(vocab.allowed_ids[:8].tolist()), str)


def test_arrival_offsets() -> None:
    rng = np.random.default_rng(0)
    assert arrival_offsets_s(4, math.inf, 1.0, rng) == [0.0] * 4
    assert arrival_offsets_s(4, 2.0, math.inf, rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_offsets_s(50, 10.0, 1.0, rng)
    assert poisson[-1] == pytest.approx(5.0)  # rescaled so the last arrival is at num / rate
    assert all(b >= a for a, b in itertools.pairwise(poisson))


def test_payloads_and_token_chunks() -> None:
    req = sample_random(VOCAB, 1, 6, 3, seed=0)[0]
    comp = build_payload("openai", "m", req, VOCAB, 0.0, ignore_eos=True)
    assert comp["prompt"] == req.prompt_ids and comp["max_tokens"] == 3
    assert comp["ignore_eos"] is True and comp["stream_options"] == {"include_usage": True}
    chat = build_payload("openai-chat", "m", req, VOCAB, 0.0, ignore_eos=False)
    assert chat["messages"][0]["content"] == VOCAB.decode(req.prompt_ids)
    assert "ignore_eos" not in chat and "prompt" not in chat
    assert is_token_chunk({"choices": [{"text": ""}]}, chat=False)
    assert not is_token_chunk({"choices": [], "usage": {"completion_tokens": 3}}, chat=False)
    assert not is_token_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, True)
    assert not is_token_chunk({"choices": [{"delta": {}, "finish_reason": "stop"}]}, chat=True)
    assert is_token_chunk({"choices": [{"delta": {"content": "hi"}}]}, chat=True)


# -- end to end against a fake server -------------------------------------------------------------

TTFT_S = 0.15
ITL_S = 0.03


def _sse(event: dict[str, Any] | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


def make_fake_server(received: list[dict[str, Any]], fail_modes: bool) -> FastAPI:
    """An OpenAI-style streaming server: TTFT_S before the first chunk, ITL_S between chunks, one
    chunk per token. With fail_modes, arrival n % 4 == 2 gets HTTP 500 and n % 4 == 3 a stream
    that breaks after two chunks."""
    app = FastAPI()
    arrivals = itertools.count()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool, breaks: bool) -> AsyncIterator[str]:
        n_out = body["max_tokens"]
        n_in = len(body["prompt"]) if not chat else 11
        await asyncio.sleep(TTFT_S)
        if chat:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n_out):
            if i:
                await asyncio.sleep(ITL_S)
            if breaks and i == 2:
                raise RuntimeError("injected stream break")
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            yield _sse({"choices": [choice]})
        if chat:
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
        yield _sse({"choices": [], "usage": usage})
        yield _sse("[DONE]")

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        received.append(body)
        mode = next(arrivals) % 4 if fail_modes else 0
        if mode == 2:
            return JSONResponse({"error": "injected"}, status_code=500)
        return StreamingResponse(stream(body, chat, mode == 3), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(base URL, list of received request bodies) of a fake server in a thread of this process."""
    received: list[dict[str, Any]] = []
    app = make_fake_server(received, fail_modes=getattr(request, "param", False))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", received
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        sock.close()


def run_bench(base_url: str, tokenizer: str, out: Path, *extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "pdserve.bench", "serve", "--base-url", base_url,
        "--tokenizer", tokenizer, "--result-file", str(out), "--disable-tqdm", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    return json.loads(out.read_text())


def test_end_to_end_timings(fake_server, tiny_llama: str, tmp_path: Path) -> None:
    base_url, received = fake_server
    r = run_bench(
        base_url, tiny_llama, tmp_path / "r.json",
        "--num-prompts", "8", "--random-input-len", "24", "--random-output-len", "6",
        "--max-concurrency", "4", "--goodput", "ttft:10000",
    )  # fmt: skip
    assert (r["completed"], r["failed"], r["model_id"]) == (8, 0, "fake-model")
    assert r["output_lens"] == [6] * 8 and r["input_lens"] == [24] * 8
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (192, 48)
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert len(received) == 8
    assert all(len(b["prompt"]) == 24 and b["ignore_eos"] and b["stream"] for b in received)
    # the injected delays, with room for a loaded machine
    assert TTFT_S * 1000 <= r["median_ttft_ms"] < TTFT_S * 1000 + 60
    assert ITL_S * 1000 - 5 <= r["median_itl_ms"] < ITL_S * 1000 + 15
    assert ITL_S * 1000 - 5 <= r["mean_tpot_ms"] < ITL_S * 1000 + 15
    assert all(len(itl) == 5 for itl in r["itls"])
    # two waves of 4 requests (concurrency 4), each TTFT + 5 ITL long
    one_request_s = TTFT_S + 5 * ITL_S
    assert 2 * one_request_s <= r["duration"] < 2 * one_request_s + 1.0
    assert {"p50_ttft_ms", "p99_itl_ms", "median_e2el_ms", "mean_tpot_ms"} <= r.keys()
    assert 0 <= r["client_stall_p99_ms"] <= r["client_stall_max_ms"]


@pytest.mark.parametrize("fake_server", [True], indirect=True)
def test_end_to_end_failures_are_counted(fake_server, tiny_llama: str, tmp_path: Path) -> None:
    base_url, _ = fake_server
    r = run_bench(
        base_url, tiny_llama, tmp_path / "r.json",
        "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "4",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (6, 6)  # arrivals 2, 6, 10 -> 500; 3, 7, 11 broken
    errors = [e for e in r["errors"] if e]
    assert sum(e.startswith("HTTP 500") for e in errors) == 3
    assert sum("RemoteProtocolError" in e for e in errors) == 3
    assert r["total_output_tokens"] == 24


def test_end_to_end_chat(fake_server, tiny_llama: str, tmp_path: Path) -> None:
    base_url, received = fake_server
    r = run_bench(
        base_url, tiny_llama, tmp_path / "r.json", "--backend", "openai-chat",
        "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
    )  # fmt: skip
    assert (r["completed"], r["output_lens"], r["input_lens"]) == (3, [4] * 3, [11] * 3)
    # the role-only and finish-only chunks are not tokens: 4 tokens -> 3 gaps
    assert all(len(itl) == 3 for itl in r["itls"])
    assert all(isinstance(b["messages"][0]["content"], str) for b in received)
