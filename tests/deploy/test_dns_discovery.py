"""The gateway's DNS discovery with real decode nodes while requests run: a node that appears
under the name is routed to within seconds, a node that disappears (and is SIGTERMed, as a
scaled-down pod is) gets no new requests while the stream it is running finishes, and no
request fails. The name is resolved by an injected resolver; the two nodes listen on the same
port of two loopback addresses, as two pods behind a headless Service do."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.discovery import Resolver
from pdserve.gateway.main import Listening, serve
from tests.deploy.described import wait_until
from tests.gateway.harness import BackgroundLoop
from tests.integration.procs import Proc, free_port, wait_grpc_serving

NAME = "decode.pool.svc"
NODE_FLAGS = [
    "--kv-transport", "tcp", "--block-size", "16", "--num-blocks", "512", "--dtype", "float32",
    "--max-model-len", "2048", "--num-threads", "1", "--drain-timeout-s", "60",
]  # fmt: skip
LONG_TOKENS = 1900
"""The stream kept running on the node that is removed (seconds of decoding here). It must
outlive the window in which the test counts requests on that node: the node's request metrics
are observed when a request ends, so the long one ending there reads as a request routed to it
(450 tokens did end inside the window on this machine, every run)."""
SHORT_TOKENS = 8


def bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def counter(metrics_port: int, metric: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(metric + "{"))


class Load:
    """Client threads sending short completions until stopped; every outcome recorded."""

    def __init__(self, base_url: str, num_threads: int) -> None:
        self.base_url = base_url
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(num_threads)]

    def _run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "the pool",
            "max_tokens": SHORT_TOKENS,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not self._stop.is_set():
                try:
                    r = client.post("/v1/completions", json=body)
                    tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                    ok = r.status_code == 200 and tokens == SHORT_TOKENS
                    self.outcomes.append("ok" if ok else f"{r.status_code} {r.text[:200]}")
                except Exception as exc:  # noqa: BLE001 - a failed request is what we look for
                    self.outcomes.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@dataclass
class DecodeNode:
    """A `pdserve decode` process on host:port, with its /metrics on metrics_port."""

    proc: Proc
    host: str
    metrics_port: int

    def served(self) -> float:
        """Requests finished on the node."""
        return counter(self.metrics_port, "pdserve:request_success_total")

    def started(self) -> float:
        """Requests the node began (one queue-time observation each)."""
        return counter(self.metrics_port, "pdserve:request_queue_time_seconds_count")


@contextlib.contextmanager
def decode_nodes(model: str, hosts: list[str], port: int, log_dir: Path) -> Iterator[list]:
    nodes = []
    try:
        for i, host in enumerate(hosts):
            metrics_port = free_port()
            argv = ["decode", "--model", model, "--host", host, "--port", str(port)]
            argv += ["--metrics-port", str(metrics_port), *NODE_FLAGS]
            nodes.append(DecodeNode(Proc(argv, log_dir / f"decode-{i}.log"), host, metrics_port))
        for node in nodes:
            wait_grpc_serving(f"{node.host}:{port}", node.proc)
        yield nodes
    finally:
        for node in nodes:
            node.proc.stop()


@contextlib.contextmanager
def gateway(config: GatewayConfig, resolver: Resolver) -> Iterator[str]:
    """The gateway (gateway.main.serve, resolver injected) on a background loop; its URL."""
    bg = BackgroundLoop()
    listening: list[Listening] = []
    stop = bg.run(_event())
    served = asyncio.run_coroutine_threadsafe(
        serve(config, stop, listening.append, resolver=resolver), bg.loop
    )
    try:
        wait_until(lambda: bool(listening) or served.done(), [], 30, "the gateway")
        assert listening, served.result()
        yield f"http://127.0.0.1:{listening[0].rest_port}"
    finally:
        bg.loop.call_soon_threadsafe(stop.set)
        served.result(30)
        bg.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()


def removed_streams(caplog: pytest.LogCaptureFixture, address: str) -> int:
    """How many streams were open on the node at address when discovery removed it."""
    (message,) = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    match = re.fullmatch(
        rf"decode node {re.escape(address)} removed \((\d+) streams open\)", message
    )
    assert match, message
    return int(match.group(1))


def test_decode_nodes_follow_dns_while_requests_run(
    tiny_llama: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.gateway.registry")
    port = free_port()
    if not bindable("127.0.0.2", port):
        pytest.skip("127.0.0.2 is not usable here")
    records = {NAME: ["127.0.0.1"]}

    async def resolver(host: str, _port: int) -> list[str]:
        return list(records[host])

    config = GatewayConfig(
        model=tiny_llama,
        served_model_name="tiny",
        decode_nodes=(f"{NAME}:{port}",),
        port=0,
        grpc_port=None,
        dns_refresh_s=0.2,
        poll_interval_s=0.2,
    )
    with (
        decode_nodes(tiny_llama, ["127.0.0.1", "127.0.0.2"], port, tmp_path) as (a, b),
        gateway(config, resolver) as base_url,
    ):
        procs = [a.proc, b.proc]
        long_result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            body = {"model": "tiny", "prompt": "a", "max_tokens": LONG_TOKENS, "ignore_eos": True}
            long_result["r"] = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)

        long_thread = threading.Thread(target=long_request)
        with Load(base_url, num_threads=3) as load:
            long_thread.start()  # only node a is known: it runs there
            wait_until(lambda: a.served() >= 3, procs, 30, "traffic on a")

            records[NAME] = [a.host, b.host]  # scale-up
            added_s = time.monotonic()
            wait_until(lambda: b.served() >= 2, procs, 10, "traffic on b")
            pickup_s = time.monotonic() - added_s

            records[NAME] = [b.host]  # scale-down: a leaves DNS
            assert long_thread.is_alive(), "the long request ended before node a was removed"
            time.sleep(0.5)  # a refresh (0.2 s) plus a request or two routed just before it
            assert removed_streams(caplog, f"{a.host}:{port}") >= 1  # the long one at least
            started_on_a, served_by_b = a.started(), b.served()
            wait_until(lambda: b.served() >= served_by_b + 6, procs, 20, "more traffic on b")
            assert a.started() == started_on_a  # nothing new for a, though it still serves
            a.proc.process.send_signal(signal.SIGTERM)  # as the kubelet does: a drains, exits
        long_thread.join(120)
        assert a.proc.process.wait(60) == 0, a.proc.log()  # drained, then exited
    failed = [outcome for outcome in load.outcomes if outcome != "ok"]
    assert not failed, failed[:5]
    assert len(load.outcomes) >= 12
    r = long_result["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LONG_TOKENS
    assert pickup_s < 5, f"node b took {pickup_s:.1f} s to get traffic"
