"""Prometheus on every tier: after a small load through the openai client, each process's
/metrics holds plausible values (the gateway's equal what the clients were told), promtool
accepts every exposition, and a real Prometheus server with the shipped scrape config scrapes
the stack and answers a TTFT p99 query."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import openai
import pytest

from tests.integration.procs import ROOT, free_port
from tests.observability.scrape import Samples, metrics_addresses, scrape

TIMEOUT_S = 60.0
COLON_LINT = "metric names should not contain ':'"
TTFT_P99 = (
    "histogram_quantile(0.99, sum by (le) (rate(pdserve:time_to_first_token_seconds_bucket[1m])))"
)


def send_load(stack) -> list:
    """Four requests: long (prefilled remotely) and short (locally), streamed and not."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", timeout=TIMEOUT_S)
    # The long prompts differ from the first block on: neither is in a prefix cache.
    long_texts = [f"{word} scrapes every tier of the stack. " * 10 for word in ("One", "Two")]
    results = []
    for i, text in enumerate([long_texts[0], "hi", long_texts[1], "short one"]):
        messages = [{"role": "user", "content": text}]
        if i == 2:
            stream = client.chat.completions.create(
                model=stack.model,
                messages=messages,
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            reason = next(
                c.choices[0].finish_reason
                for c in chunks
                if c.choices and c.choices[0].finish_reason
            )
            results.append((chunks[-1].usage, reason))
        else:
            r = client.chat.completions.create(
                model=stack.model, messages=messages, max_tokens=5 + i, temperature=0.0
            )
            results.append((r.usage, r.choices[0].finish_reason))
    return results


def delta(after: Samples, before: Samples, sample_name: str, **labels: str) -> float:
    return after.value(sample_name, **labels) - before.value(sample_name, **labels)


def test_every_tier_exports_plausible_metrics(stack):
    addresses = metrics_addresses(stack)
    assert set(addresses) == {"gateway", "prefill-0", "decode-0"} and all(addresses.values())
    before = {name: Samples(scrape(a)) for name, a in addresses.items()}
    results = send_load(stack)
    stack.wait_all_blocks_free()
    after = {name: Samples(scrape(a)) for name, a in addresses.items()}

    num = len(results)
    prompt_tokens = sum(u.prompt_tokens for u, _ in results)
    completion_tokens = sum(u.completion_tokens for u, _ in results)
    reasons = Counter(reason for _, reason in results)
    gw_a, gw_b = after["gateway"], before["gateway"]
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(gw_a, gw_b, f"pdserve:{histogram}_count", role="gateway") == num
    # one chunk per token without speculative decoding: a gap before each but the first
    itl = delta(gw_a, gw_b, "pdserve:inter_token_latency_seconds_count")
    assert itl == completion_tokens - num
    assert delta(gw_a, gw_b, "pdserve:generation_tokens_total") == completion_tokens
    assert delta(gw_a, gw_b, "pdserve:prompt_tokens_total") == prompt_tokens
    assert delta(gw_a, gw_b, "pdserve:request_generation_tokens_sum") == completion_tokens
    for reason, count in reasons.items():
        got = delta(gw_a, gw_b, "pdserve:request_success_total", finished_reason=reason)
        assert got == count, (reason, got, count)
    assert 0 < delta(gw_a, gw_b, "pdserve:time_to_first_token_seconds_sum") < 60 * num
    assert gw_a.value("pdserve:gateway_requests_in_flight") == 0

    dec_a, dec_b = after["decode-0"], before["decode-0"]
    assert delta(dec_a, dec_b, "pdserve:generation_tokens_total") == completion_tokens
    for phase in ("queue", "prefill", "decode"):
        assert delta(dec_a, dec_b, f"pdserve:request_{phase}_time_seconds_count") == num
    for reason, count in reasons.items():
        assert delta(dec_a, dec_b, "pdserve:request_success_total", finished_reason=reason) == count
    assert delta(dec_a, dec_b, "pdserve:prefix_cache_queries_total") > 0

    pre_a, pre_b = after["prefill-0"], before["prefill-0"]
    remote = delta(pre_a, pre_b, "pdserve:request_prefill_time_seconds_count")
    assert remote == 2, "the two long prompts go to the prefill node"
    assert delta(pre_a, pre_b, "pdserve:prompt_tokens_total") > 0
    sent = delta(pre_a, pre_b, "pdserve:kv_transfer_bytes_total")
    assert sent > 0 and sent == delta(dec_a, dec_b, "pdserve:kv_transfer_bytes_total")
    assert delta(dec_a, dec_b, "pdserve:kv_transfer_seconds_count") == remote
    for node in ("decode-0", "prefill-0"):
        samples = after[node]
        assert samples.value("pdserve:kv_cache_usage_perc", role=node[:-2]) == 0.0
        assert samples.value("pdserve:num_requests_running") == 0
        assert samples.value("pdserve:num_requests_waiting") == 0
        assert samples.value("pdserve:kv_transfer_failures_total") == 0
        assert samples.has("pdserve:num_preemptions_total")
        assert samples.has("process_cpu_seconds_total")


def _promtool_problems(exposition: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    lines = (result.stdout + result.stderr).splitlines()
    return result.returncode, [line for line in lines if line.strip()]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (prometheus)")
def test_promtool_accepts_every_exposition(stack):
    """promtool's only complaint may be the `pdserve:` prefix itself: the design mandates it,
    as vLLM's `vllm:` (promtool reserves colons for recording rules). With the prefix spelled
    `pdserve_`, every exposition is lint-clean."""
    for name, address in metrics_addresses(stack).items():
        text = scrape(address)
        code, problems = _promtool_problems(text)
        assert code in (0, 3), f"{name}: promtool failed to parse:\n{problems}"
        others = [p for p in problems if COLON_LINT not in p]
        assert not others, f"{name}: {others}"
        code, problems = _promtool_problems(
            text.replace("pdserve:", "pdserve_").replace("vllm:", "vllm_")
        )
        assert code == 0, f"{name}: {problems}"


def grafana_queries() -> list[str]:
    """The PromQL of every panel of deploy/grafana/pdserve-dashboard.json, with the dashboard's
    variables filled in."""
    dashboard = json.loads((ROOT / "deploy/grafana/pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    return [e.replace("$model_name", ".*").replace("$__rate_interval", "1m") for e in exprs]


def _query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _wait(check, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
        try:
            value = check()
        except OSError:
            value = None
        if value is not None:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_prometheus_scrapes_the_stack_with_the_shipped_config(stack, tmp_path):
    gateway = stack.nodes["gateway"]["metrics_address"]
    config = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    settings = [line for line in config.splitlines() if not line.lstrip().startswith("#")]
    assert sum("127.0.0.1:8000" in line for line in settings) == 2  # the gateway and its SD
    config = config.replace("127.0.0.1:8000", gateway)
    config = re.sub(r"(scrape|evaluation)_interval: \d+s", r"\1_interval: 1s", config)
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    log = tmp_path / "prometheus.log"
    cmd = ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}"]
    cmd += [f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        up = 'sum(up{job=~"pdserve-.*"})'

        def all_up():
            result = _query(base, up)
            return True if result and float(result[0]["value"][1]) == 3 else None

        _wait(all_up, 60, "gateway + 2 nodes up", proc, log)
        send_load(stack)

        def p99():
            result = _query(base, TTFT_P99)
            value = float(result[0]["value"][1]) if result else math.nan
            return value if math.isfinite(value) else None

        ttft_p99 = _wait(p99, 30, "a finite TTFT p99", proc, log)
        assert 0 < ttft_p99 < 160
        by_role = _query(base, "sum by (role) (pdserve:generation_tokens_total)")
        assert {r["metric"]["role"] for r in by_role} == {"gateway", "prefill", "decode"}
        for expr in grafana_queries():  # every panel of the shipped dashboard is valid PromQL
            _query(base, expr)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
