"""The life every node process shares, whatever its role: `serve_node` builds the engine, serves
gRPC with health checking and reflection, drains on SIGTERM and cleans up. A role (prefill_node/,
decode_node/) is a `NodeRole`: its KV transport, its servicer, and how it closes.

    parse config -> role.start (transport) -> build engine -> metrics -> engine loop
      -> role.servicer -> gRPC server -> serve until SIGTERM/SIGINT -> drain -> clean up
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import socket
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from pdserve.common import tracing
from pdserve.common.grpc_messages import MalformedRequestInterceptor
from pdserve.common.metrics import MetricsServer
from pdserve.common.node_config import NodeConfig
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.node_service import ErrorInterceptor, NodeService
from pdserve.common.tls import TLSFiles, add_port
from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.core_turns import CoreTurns
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import EngineKVConnector, LLMEngine
from pdserve.engine.platform import freeze_startup_objects

logger = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
SERVER_STOP_GRACE_S = 2.0
"""After draining, how long the gRPC server lets calls still open finish."""


def build_engine(
    engine_args: EngineArgs, config: NodeConfig, kv_connector: EngineKVConnector | None = None
) -> LLMEngine:
    """The node's engine (its configs validated: ValueError names a bad setting); sets the
    process's torch threads to config.num_threads."""
    configs = engine_args.to_configs()
    if configs.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "--pipeline-parallel-size > 1 is offline-only yet (LLM, pdserve generate): the KV "
            "transfer does not gather layers from stages"
        )
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    return LLMEngine(
        configs.model_config,
        configs.cache_config,
        configs.scheduler_config,
        speculative_config=configs.speculative_config,
        kv_connector=kv_connector,
        lora_config=configs.lora_config,
        parallel_config=configs.parallel_config,
    )


def served_model_name(config: NodeConfig, engine_args: EngineArgs) -> str:
    return config.served_model_name or engine_args.model


_FINGERPRINT_SUFFIXES = (".json", ".safetensors", ".gguf", ".bin", ".model", ".jinja", ".txt")
_FINGERPRINT_SAMPLE = 1 << 20


def checkpoint_fingerprint(model: str) -> str:
    """A short fingerprint of the checkpoint at model (a directory or a GGUF file): each
    file's name, size and first and last MiB. Cheap at any model size, and different for any
    two checkpoints a rolling update swaps (new weights change their bytes, and configs are
    read whole)."""
    path = Path(model)
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _FINGERPRINT_SUFFIXES)
    )
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SAMPLE))
            if size > 2 * _FINGERPRINT_SAMPLE:
                f.seek(size - _FINGERPRINT_SAMPLE)
                digest.update(f.read())
    return digest.hexdigest()[:12]


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

    def __init__(
        self, host: str, port: int, service_names: list[str], tls: TLSFiles | None = None
    ) -> None:
        # outermost first: a malformed message is INVALID_ARGUMENT before the error mapping
        interceptors = [MalformedRequestInterceptor(), ErrorInterceptor()]
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self._service_names = service_names
        self.port = add_port(self.server, f"{host}:{port}", tls)
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


@dataclass(frozen=True)
class NodeParts:
    """What the shared life has built when a role makes its servicer."""

    engine_args: EngineArgs
    model: str
    """The served model name (reported to the gateway, in KV layouts)."""
    node_id: str
    engine_loop: EngineLoop
    metrics: NodeMetrics
    metrics_address: str
    """host:port of the node's /metrics ("" = off)."""
    model_version: str = ""
    """NodeConfig.model_version, else the checkpoint's fingerprint."""

    @property
    def layout_model(self) -> str:
        """The model id in this node's KV layouts: the served name and the weights' version,
        so KV never moves between nodes serving different weights."""
        return layout_model(self.model, self.model_version)


def layout_model(model: str, version: str) -> str:
    return f"{model}@{version}" if version else model


class NodeRole(ABC):
    """What a role adds to the shared node life. Methods run on the node's event loop, in the
    order serve_node calls them: start, servicer, add_servicer, describe, then close."""

    name: str
    """"prefill" or "decode": node ids, metrics labels, log lines."""
    service_name: str
    """Full name of the role's gRPC service (health status, reflection)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config

    @abstractmethod
    async def start(self, model: str) -> EngineKVConnector | None:
        """Start the KV transport (before the engine exists); return the engine's KV connector
        if the role has one. model: the model id of this node's KV layouts (layout_model)."""

    @abstractmethod
    def servicer(self, parts: NodeParts) -> NodeService:
        """The role's servicer over the node's engine loop."""

    @abstractmethod
    def add_servicer(self, servicer: NodeService, server: grpc.aio.Server) -> None:
        """Register servicer with the gRPC server (the generated add_*Servicer_to_server)."""

    def describe(self) -> str:
        """Extra words for the 'serving' log line."""
        return ""

    @abstractmethod
    async def close(self) -> None:
        """Stop the KV transport (the engine thread has stopped). Must not raise or hang."""


async def serve_node(role: NodeRole, engine_args: EngineArgs) -> None:
    """A node's whole life; returns after SIGTERM/SIGINT once it has drained and cleaned up."""
    config = role.config
    loop = asyncio.get_running_loop()
    stop = _stop_event_on_signals(loop)
    model = served_model_name(config, engine_args)
    version = config.model_version or checkpoint_fingerprint(engine_args.model)
    this_node = node_id(config, role.name)
    tracing.setup(role.name, this_node)
    metrics_server: MetricsServer | None = None
    try:
        connector = await role.start(layout_model(model, version))
        engine = build_engine(engine_args, config, kv_connector=connector)
        metrics = NodeMetrics(engine, role.name, model, this_node)
        metrics_server = start_metrics_server(metrics.registry, config)
        turns = CoreTurns(config.shared_cores_lock) if config.shared_cores_lock else None
        engine_loop = EngineLoop(engine, loop, turns)
        parts = NodeParts(
            engine_args,
            model,
            this_node,
            engine_loop,
            metrics,
            metrics_server.address if metrics_server else "",
            version,
        )
        servicer = role.servicer(parts)
        server = NodeServer(config.host, config.port, [role.service_name], config.tls_files())
        role.add_servicer(servicer, server.server)
        freeze_startup_objects()
        engine_loop.start()
        try:
            await server.start()
            logger.info(
                "%s node %s serving %s on %s%s",
                role.name,
                this_node,
                model,
                server.address,
                role.describe(),
            )
            await stop.wait()
            await _drain(servicer, server, engine_loop, config.drain_timeout_s)
        finally:
            servicer.abort_all()
            await server.stop(SERVER_STOP_GRACE_S)
            engine_loop.stop()
    finally:
        await role.close()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()  # flushes this node's last spans
        logger.info("%s node stopped", role.name)


def _stop_event_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the node then drains and exits)."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _drain(
    servicer: NodeService, server: NodeServer, engine_loop: EngineLoop, timeout_s: float
) -> None:
    """Refuse new requests, report NOT_SERVING, wait for in-flight requests to finish
    (bounded by timeout_s), then abort what is left."""
    logger.info("draining")
    servicer.accepting = False
    await server.set_serving(False)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine_loop.num_open_streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if engine_loop.num_open_streams:
        logger.warning("aborting %d requests still running", engine_loop.num_open_streams)
        servicer.abort_all()
