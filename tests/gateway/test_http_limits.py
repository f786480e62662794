"""The REST server's read deadlines and connection cap: slow-header and slow-body clients are
cut off after --header-timeout-s while well-behaved requests (and kept-alive connections)
keep working; connections past --max-connections get 503."""

from __future__ import annotations

import socket
import time

import httpx

from tests.gateway.harness import MODEL_NAME


def _open(port: int, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes sock within seconds (reads until EOF or the deadline)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionError:
            return True
        if data == b"":
            return True
    return False


def test_slow_headers_and_bodies_are_cut_off_and_others_keep_working(make_cluster):
    cluster = make_cluster(header_timeout_s=1.0)
    port = cluster.listening.rest_port
    silent = [_open(port, b"") for _ in range(20)]
    partial_headers = [
        _open(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)
    ]
    body = b'{"model": "tiny", "prompt": "hi"}'
    slow_body = [
        _open(
            port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5],
        )
        for _ in range(5)
    ]
    started = time.monotonic()
    with httpx.Client(base_url=cluster.base_url, timeout=10) as client:
        # a kept-alive connection idles longer than the read deadline between requests
        for _ in range(2):
            reply = client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3},
            )
            assert reply.status_code == 200, reply.text
            time.sleep(1.5)
    for sock in silent + partial_headers + slow_body:
        assert _closed_within(sock, 5.0), "a slow connection was held open"
        sock.close()
    assert time.monotonic() - started < 15


def test_connections_past_the_cap_get_503(make_cluster):
    cluster = make_cluster(max_connections=4, header_timeout_s=30.0)
    port = cluster.listening.rest_port
    held = [_open(port, b"") for _ in range(4)]
    try:
        reply = httpx.get(f"{cluster.base_url}/health", timeout=10)
        assert reply.status_code == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{cluster.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the cap did not free up"
        time.sleep(0.1)
