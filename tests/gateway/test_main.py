"""The gateway process: flags and config validation, idle HTTP connections, and
`python -m gateway.main` serving, then draining on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.main import add_arguments, config_from_args
from tests.gateway.conftest import StartCluster
from tests.gateway.fake_nodes import DecodeBehaviour, FakeDecodeNode, start_decode_node
from tests.gateway.harness import BackgroundLoop, Cluster

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flag_defaults() -> None:
    config = config_from_args(parse("--model", "models/x/", "--decode-nodes", "h:1, h:2"))
    assert config.served_model_name == "models/x/"
    assert config.decode_nodes == ("h:1", "h:2") and config.prefill_nodes == ()
    assert (config.host, config.port, config.grpc_port) == ("127.0.0.1", 8000, 50051)
    assert config.max_model_len is None
    assert config.keep_alive_timeout_s == 30.0
    config = config_from_args(
        parse(
            "--model", "m", "--decode-nodes", "h:1", "--grpc-port", "0", "--served-model-name", "n"
        )
    )
    assert config.grpc_port is None and config.served_model_name == "n"


def test_top_level_log_level_survives_the_sub_command() -> None:
    """How `pdserve gateway` wires the flags: --log-level also exists on the parent parser."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="INFO")
    add_arguments(parser.add_subparsers(dest="command").add_parser("gateway"))
    args = parser.parse_args(
        ["--log-level", "DEBUG", "gateway", "--model", "m", "--decode-nodes", "h:1"]
    )
    assert config_from_args(args).log_level == "DEBUG"
    args = parser.parse_args(
        ["gateway", "--model", "m", "--decode-nodes", "h:1", "--log-level", "WARNING"]
    )
    assert config_from_args(args).log_level == "WARNING"
    assert config_from_args(parse("--model", "m", "--decode-nodes", "h:1")).log_level == "INFO"


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"decode_nodes": ()}, "at least one decode node"),
        ({"decode_nodes": ("nohost",)}, "not host:port"),
        ({"prefill_nodes": ("h:99999",)}, "not host:port"),
        ({"port": -1}, "port"),
        ({"max_num_requests": 0}, "max_num_requests"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"keep_alive_timeout_s": 0}, "keep_alive_timeout_s"),
        ({"log_level": "LOUD"}, "log level"),
    ],
)
def test_config_validation(changes: dict, message: str) -> None:
    settings = {"model": "m", "served_model_name": "m", "decode_nodes": ("h:1",), **changes}
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**settings)


def _idle_connection_closed_within(base_url: str, wait_s: float) -> bool:
    """One keep-alive request on a raw socket, then: did the server close the idle connection
    within wait_s?"""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while b"\r\n\r\n" not in response:  # /health answers with headers and a tiny body
            chunk = sock.recv(4096)
            assert chunk, "closed before answering"
            response += chunk
        assert response.startswith(b"HTTP/1.1 200"), response
        sock.settimeout(wait_s)
        try:
            while sock.recv(4096):  # the rest of the body, then b"" once the server closes
                pass
        except TimeoutError:
            return False
        return True


def test_idle_connections_outlive_the_clients_pool_expiry(gw: Cluster) -> None:
    """The keep-alive race behind a flake of test_mixed_concurrent_good_and_bad: when the server
    closed an idle connection (uvicorn's 5 s default) just as the client reused it, the request
    died with httpx.ReadError. The gateway keeps idle connections longer than httpx's 5 s."""
    assert not _idle_connection_closed_within(gw.base_url, 6.0)


def test_idle_connections_close_after_keep_alive_timeout(make_cluster: StartCluster) -> None:
    cluster = make_cluster(keep_alive_timeout_s=0.3)
    assert _idle_connection_closed_within(cluster.base_url, 5.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def decode_port(bg_loop: BackgroundLoop, script: list[int]) -> Iterator[int]:
    node = FakeDecodeNode(DecodeBehaviour(script=script, token_delay_s=0.05))
    port = bg_loop.run(start_decode_node(node))
    yield port
    assert node.server is not None
    bg_loop.run(node.server.stop(None))


def test_process_serves_then_drains_on_sigterm(tiny_llama: str, decode_port: int) -> None:
    port = free_port()
    argv = [
        sys.executable, "-m", "pdserve.gateway.main",
        "--model", tiny_llama,
        "--served-model-name", "tiny",
        "--decode-nodes", f"127.0.0.1:{decode_port}",
        "--port", str(port),
        "--grpc-port", "0",
        "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, "the gateway did not become healthy"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        result: dict[str, httpx.Response] = {}
        body = {"model": "tiny", "prompt": "a", "max_tokens": 20}  # ~1 s of tokens
        worker = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(f"{base}/v1/completions", json=body, timeout=10)
            )
        )
        worker.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        worker.join(10)
        assert result["r"].status_code == 200  # the request in flight finished
        assert result["r"].json()["usage"]["completion_tokens"] == 20
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
