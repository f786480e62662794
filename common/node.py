"""What the prefill and decode node processes share: their configs (flags), engine construction,
the gRPC server with health checking and reflection, load reports, and signal handling."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Self

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from pdserve.common.metrics import MetricsServer
from pdserve.common.node_service import ErrorInterceptor
from pdserve.engine.arg_utils import EngineArgs, add_config_flags, config_from_namespace
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import EngineKVConnector, LLMEngine

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class NodeConfig:
    """What every node process is told at start besides the engine's settings (EngineArgs):
    the flags of `pdserve prefill` and `pdserve decode` (add_cli_args)."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds."""
    port: int = 0
    """gRPC port (0 = any free)."""
    served_model_name: str | None = None
    """Model id reported to the gateway and in KV layouts; None: --model as given."""
    num_threads: int | None = None
    """Torch threads for the forward pass; None: torch's choice, all cores."""
    node_id: str | None = None
    """Stable node id; None: role-host-pid-random."""
    kv_transport: Literal["ucx", "tcp"] = "ucx"
    """KV block transport between prefill and decode nodes (ucx via ucxx, tcp fallback)."""
    metrics_port: int = 0
    """Port of the node's Prometheus /metrics (0 = off)."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics server binds."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before being aborted."""

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_transport not in ("ucx", "tcp"):
            raise ValueError(f"kv_transport must be 'ucx' or 'tcp', got {self.kv_transport!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (default and help: the field's)."""
        add_config_flags(parser.add_argument_group("node"), cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Self:
        return config_from_namespace(cls, args)


@dataclass(frozen=True)
class PrefillNodeConfig(NodeConfig):
    """A prefill node's settings (`pdserve prefill`)."""

    port: int = 50071
    prefill_timeout_s: float = 60.0
    """Deadline for one prompt's prefill and KV push."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "prefill_timeout_s")


@dataclass(frozen=True)
class DecodeNodeConfig(NodeConfig):
    """A decode node's settings (`pdserve decode`); the engine's decode-role settings (remote
    prefill, speculative decoding) are EngineArgs'."""

    port: int = 50061
    kv_host: str = "127.0.0.1"
    """Address of the KV receiver, given to prefill nodes (and bound, tcp transport); 0.0.0.0
    binds every interface and gives this host's address (a container's, a pod's)."""
    kv_port: int = 0
    """KV receiver port (0 = any free)."""
    prefill_timeout_s: float = 60.0
    """Deadline of one Prefill call on a prefill node."""
    kv_transfer_timeout_s: float = 10.0
    """How long to wait for the KV blocks after the prefill node answered."""
    token_timeout_s: float = 300.0
    """Longest gap between two tokens of a request before it fails."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_port("kv_port", self.kv_port)
        for name in ("prefill_timeout_s", "kv_transfer_timeout_s", "token_timeout_s"):
            _check_positive(self, name)


def _check_port(name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")


def _check_positive(config: NodeConfig, name: str) -> None:
    if getattr(config, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")


def build_engine(
    engine_args: EngineArgs, config: NodeConfig, kv_connector: EngineKVConnector | None = None
) -> LLMEngine:
    """The node's engine (its configs validated: ValueError names a bad setting); sets the
    process's torch threads to config.num_threads."""
    configs = engine_args.to_configs()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return LLMEngine(
        configs.model_config,
        configs.cache_config,
        configs.scheduler_config,
        speculative_config=configs.speculative_config,
        kv_connector=kv_connector,
    )


def served_model_name(config: NodeConfig, engine_args: EngineArgs) -> str:
    return config.served_model_name or engine_args.model


def node_id(config: NodeConfig, role: str) -> str:
    return config.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def start_metrics_server(registry: CollectorRegistry, config: NodeConfig) -> MetricsServer | None:
    """The node's Prometheus /metrics server, listening, when --metrics-port is set."""
    if not config.metrics_port:
        return None
    server = MetricsServer(registry, config.metrics_host, config.metrics_port)
    server.start()
    return server


class NodeServer:
    """A grpc.aio server with the standard health service, reflection, and the error
    interceptor (common/node_service.py) that maps what RPC methods raise to status codes."""

    def __init__(self, host: str, port: int, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[ErrorInterceptor()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self._service_names = service_names
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


def stop_event_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the node then drains and exits)."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain(
    loop: EngineLoop, timeout_s: float, abort_all: Callable[[], None], label: str
) -> None:
    """Wait for in-flight requests to finish (bounded), then abort what is left."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while loop.num_open_streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if loop.num_open_streams:
        logger.warning("%s: aborting %d requests still running", label, loop.num_open_streams)
        abort_all()
