"""What the prefill and decode node processes share: flags, engine construction, the gRPC
server with health checking and reflection, load reports, and signal handling."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from pdserve.common.metrics import MetricsServer
from pdserve.common.node_service import ErrorInterceptor
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import EngineKVConnector, LLMEngine

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]


def add_node_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """Flags every node has (engine flags come from pdserve.cli.add_engine_args)."""
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0 = any free)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id reported to the gateway and in KV layouts (default: --model as given)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for the forward pass (default: torch's choice, all cores)",
    )
    p.add_argument("--node-id", default=None, help="stable node id (default: host-pid-random)")
    p.add_argument(
        "--kv-transport",
        default="ucx",
        choices=["ucx", "tcp"],
        help="KV block transport between prefill and decode nodes (ucx via ucxx, tcp fallback)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="port of the node's Prometheus /metrics (0 = off)",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the /metrics server binds")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may take to finish before being aborted",
    )


def build_engine(
    args: argparse.Namespace,
    remote_prefill_min_tokens: int = 1,
    max_remote_prefill_queue_tokens: int = 0,
    speculative_config: SpeculativeConfig | None = None,
    kv_connector: EngineKVConnector | None = None,
) -> LLMEngine:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    return LLMEngine(
        ModelConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed
        ),
        CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            remote_prefill_min_tokens=remote_prefill_min_tokens,
            max_remote_prefill_queue_tokens=max_remote_prefill_queue_tokens,
        ),
        speculative_config=speculative_config,
        kv_connector=kv_connector,
    )


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model


def node_id(args: argparse.Namespace, role: str) -> str:
    return args.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def start_metrics_server(
    registry: CollectorRegistry, args: argparse.Namespace
) -> MetricsServer | None:
    """The node's Prometheus /metrics server, listening, when --metrics-port is set."""
    if not args.metrics_port:
        return None
    server = MetricsServer(registry, args.metrics_host, args.metrics_port)
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
