"""Runs fake nodes and an in-process gateway on a background event loop, so tests can use
ordinary blocking clients (the openai client, httpx, grpc stubs) from the test thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.main import Listening, serve
from tests.gateway.fake_nodes import (
    DecodeBehaviour,
    FakeDecodeNode,
    FakePrefillNode,
    start_decode_node,
    start_prefill_node,
)

T = TypeVar("T")
MODEL_NAME = "tiny"
SCRIPT_TEXT = "Hello wörld, 你好! The quick brown fox jumps over the lazy dog. "


class BackgroundLoop:
    """An asyncio loop on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@dataclass
class Cluster:
    """Fake decode and prefill nodes plus a gateway in front of them."""

    bg: BackgroundLoop
    config: GatewayConfig
    decode_nodes: list[FakeDecodeNode]
    decode_ports: list[int]
    prefill_nodes: list[FakePrefillNode]
    prefill_servers: list[grpc.aio.Server]
    listening: Listening
    stop_event: asyncio.Event
    """Set it (on the loop) to make the gateway drain and stop, as SIGTERM does."""
    _task: asyncio.Task[None]
    base_behaviour: list[DecodeBehaviour] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listening.rest_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.listening.grpc_port}"

    def reset(self) -> None:
        """Back to the behaviour the cluster started with; forget recorded calls."""
        for node, behaviour in zip(self.decode_nodes, self.base_behaviour, strict=True):
            node.behaviour = replace(behaviour)
            node.calls.clear()

    def kill_decode_node(self, index: int) -> None:
        server = self.decode_nodes[index].server
        assert server is not None
        self.bg.run(server.stop(None))

    def stop(self) -> None:
        self.bg.run(self._shutdown(), timeout_s=30)

    async def _shutdown(self) -> None:
        self.stop_event.set()
        try:
            await asyncio.wait_for(self._task, 20)
        finally:
            for node in self.decode_nodes:
                if node.server is not None:
                    await node.server.stop(None)
            for server in self.prefill_servers:
                await server.stop(None)


def start_cluster(
    bg: BackgroundLoop,
    model_dir: str,
    script: list[int],
    num_decode: int = 2,
    num_prefill: int = 1,
    decode_behaviour: list[dict[str, Any]] | None = None,
    **config: Any,
) -> Cluster:
    """Start the nodes (decode node i with DecodeBehaviour fields decode_behaviour[i]) and a
    gateway (REST and gRPC on free ports) on bg's loop."""
    behaviours = [
        DecodeBehaviour(script=list(script), **(decode_behaviour or [{}] * num_decode)[i])
        for i in range(num_decode)
    ]
    return bg.run(_start(bg, model_dir, behaviours, num_prefill, config))


async def _start(
    bg: BackgroundLoop,
    model_dir: str,
    behaviours: list[DecodeBehaviour],
    num_prefill: int,
    overrides: dict[str, Any],
) -> Cluster:
    decode_nodes = [
        FakeDecodeNode(replace(b), node_id=f"decode{i}") for i, b in enumerate(behaviours)
    ]
    decode_ports = [await start_decode_node(node) for node in decode_nodes]
    prefill_nodes = [FakePrefillNode(node_id=f"prefill{i}") for i in range(num_prefill)]
    prefill = [await start_prefill_node(node) for node in prefill_nodes]
    settings: dict[str, Any] = dict(
        model=model_dir,
        served_model_name=MODEL_NAME,
        decode_nodes=tuple(f"127.0.0.1:{p}" for p in decode_ports),
        prefill_nodes=tuple(f"127.0.0.1:{port}" for _, port in prefill),
        port=0,
        grpc_port=0,
        request_timeout_s=10.0,
        poll_interval_s=0.1,
        drain_timeout_s=2.0,
    )
    settings.update(overrides)
    config = GatewayConfig(**settings)
    stop = asyncio.Event()
    listening: asyncio.Future[Listening] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(config, stop, listening.set_result))
    await asyncio.wait({task, listening}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    return Cluster(
        bg,
        config,
        decode_nodes,
        decode_ports,
        prefill_nodes,
        [server for server, _ in prefill],
        listening.result(),
        stop,
        task,
        behaviours,
    )
