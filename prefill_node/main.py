"""`pdserve prefill`: a prefill node — the shared node life (common/node.py) with the prefill
role: a KV push connector given to the engine, the PrefillNode service, the sender closed last."""

from __future__ import annotations

import argparse
import asyncio

import grpc

from pdserve.common.node import NodeParts, NodeRole, serve_node
from pdserve.common.node_config import PrefillNodeConfig
from pdserve.engine.arg_utils import EngineArgs
from pdserve.kvtransfer.connector import KVPushConnector
from pdserve.kvtransfer.transport import KVSender, make_sender
from pdserve.prefill_node.servicer import PrefillServicer
from pdserve.prefill_node.telemetry import PrefillTelemetry
from pdserve.v1 import node_pb2, node_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    PrefillNodeConfig.add_cli_args(p)


class PrefillRole(NodeRole):
    """Computes prompts and pushes their KV blocks as they become final."""

    name = "prefill"
    service_name = node_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name
    config: PrefillNodeConfig

    def __init__(self, config: PrefillNodeConfig) -> None:
        super().__init__(config)
        self.sender: KVSender | None = None
        self.connector: KVPushConnector | None = None

    async def start(self, model: str) -> KVPushConnector:
        self.sender = make_sender(self.config.kv_transport)
        self.connector = KVPushConnector(model, self.sender, asyncio.get_running_loop())
        return self.connector

    def servicer(self, parts: NodeParts) -> PrefillServicer:
        assert self.connector is not None  # start() ran
        return PrefillServicer(
            parts.engine_loop,
            self.connector,
            parts.node_id,
            parts.model,
            self.config.prefill_timeout_s,
            PrefillTelemetry(parts.metrics, parts.node_id),
            parts.metrics_address,
            self.config.kv_target_hosts,
            parts.model_version,
        )

    def add_servicer(self, servicer: PrefillServicer, server: grpc.aio.Server) -> None:
        node_pb2_grpc.add_PrefillNodeServicer_to_server(servicer, server)

    async def close(self) -> None:
        if self.sender is not None:
            await self.sender.close()


def run(args: argparse.Namespace) -> int:
    role = PrefillRole(PrefillNodeConfig.from_cli_args(args))
    asyncio.run(serve_node(role, EngineArgs.from_cli_args(args)))
    return 0
