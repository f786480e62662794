"""Front-door basics: the request body limit (413 before parsing, declared or chunked), CORS
for allowed origins only, a root path behind a proxy, and tokenization off the event loop (a
huge prompt does not stall the gateway for everyone else)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.gateway.harness import MODEL_NAME


def test_bodies_over_the_limit_are_413_before_parsing(make_cluster) -> None:
    cluster = make_cluster(max_request_body_bytes=64 * 1024)
    url = f"{cluster.base_url}/v1/completions"
    big = {"model": MODEL_NAME, "prompt": "x " * 40_000, "max_tokens": 1}
    reply = httpx.post(url, json=big, timeout=10)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(20):
            yield b"x" * 8192  # no Content-Length: chunked, 160 KB in all

    reply = httpx.post(
        url, content=chunks(), headers={"content-type": "application/json"}, timeout=10
    )
    assert reply.status_code == 413
    ok = httpx.post(url, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


def test_cors_for_allowed_origins_only(make_cluster) -> None:
    cluster = make_cluster(allowed_origins=("https://app.example.com",))
    preflight = {
        "Origin": "https://app.example.com",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    reply = httpx.options(f"{cluster.base_url}/v1/completions", headers=preflight, timeout=10)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "https://app.example.com"
    other = httpx.options(
        f"{cluster.base_url}/v1/completions",
        headers={**preflight, "Origin": "https://evil.example.com"},
        timeout=10,
    )
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_by_default(gw) -> None:
    reply = httpx.get(
        f"{gw.base_url}/v1/models", headers={"Origin": "https://x.example"}, timeout=10
    )
    assert "access-control-allow-origin" not in reply.headers


def test_a_huge_prompt_does_not_hold_the_event_loop(make_cluster) -> None:
    """Tokenizing a ~3 MB prompt takes seconds; meanwhile /health keeps answering at once."""
    cluster = make_cluster(max_request_body_bytes=16 << 20)
    prompt = "the quick brown fox jumps over the lazy dog " * 70_000
    done = threading.Event()

    def huge() -> None:
        try:
            httpx.post(
                f"{cluster.base_url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
                timeout=120,
            )
        finally:
            done.set()

    worker = threading.Thread(target=huge)
    start = time.monotonic()
    worker.start()
    slowest = 0.0
    probes = 0
    while not done.is_set():
        t = time.monotonic()
        assert httpx.get(f"{cluster.base_url}/health", timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - t)
        probes += 1
        time.sleep(0.05)
    worker.join(120)
    took = time.monotonic() - start
    assert took > 1.0, "the prompt was not big enough to show anything"
    assert slowest < 0.5 * took, (slowest, took, probes)


def test_served_model_name_aliases(make_cluster) -> None:
    import openai

    cluster = make_cluster(served_model_aliases=("alias-a", "alias-b"))
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "alias-a", "alias-b"]
    for name in (MODEL_NAME, "alias-b"):
        out = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert out.model == name
    try:
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("an unknown model name was accepted")


def test_request_logging_is_off_by_default_and_cut_to_max_log_len(make_cluster, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="pdserve.gateway.server")
    body = {"model": MODEL_NAME, "prompt": list(range(10, 60)), "max_tokens": 2}
    quiet = make_cluster()
    httpx.post(f"{quiet.base_url}/v1/completions", json=body, timeout=10)
    assert not [r for r in caplog.records if "prompt tokens" in r.getMessage()]
    loud = make_cluster(enable_log_requests=True, max_log_len=5)
    httpx.post(f"{loud.base_url}/v1/completions", json=body, timeout=10)
    (line,) = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert "50 prompt tokens [10, 11, 12, 13, 14] (+45 more)" in line and "max_tokens: 2" in line
