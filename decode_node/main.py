"""`pdserve decode`: a decode node — the shared node life (common/node.py) with the decode role:
a KV receiver, a client that has prefill nodes fill reserved blocks, the DecodeNode service."""

from __future__ import annotations

import argparse
import asyncio

import grpc

from pdserve.common.node import NodeParts, NodeRole, serve_node
from pdserve.common.node_config import DecodeNodeConfig
from pdserve.decode_node.prefill_client import PrefillClient
from pdserve.decode_node.servicer import DecodeServicer
from pdserve.decode_node.telemetry import DecodeTelemetry
from pdserve.engine.arg_utils import EngineArgs
from pdserve.kvtransfer.connector import kv_layout
from pdserve.kvtransfer.transport import KVReceiver, make_receiver
from pdserve.v1 import node_pb2, node_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, decode=True)
    DecodeNodeConfig.add_cli_args(p)


class DecodeRole(NodeRole):
    """Admits requests, has their prompts prefilled remotely (or locally), streams tokens."""

    name = "decode"
    service_name = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name
    config: DecodeNodeConfig

    def __init__(self, config: DecodeNodeConfig) -> None:
        super().__init__(config)
        self.receiver: KVReceiver | None = None
        self.prefill_client: PrefillClient | None = None

    async def start(self, model: str) -> None:
        config = self.config
        self.receiver = make_receiver(config.kv_transport, host=config.kv_host, port=config.kv_port)
        await self.receiver.start()

    def servicer(self, parts: NodeParts) -> DecodeServicer:
        assert self.receiver is not None  # start() ran
        engine = parts.engine_loop.engine
        layout = kv_layout(parts.layout_model, engine.kv_blocks, engine.cache_config.block_size)
        self.prefill_client = PrefillClient(
            parts.engine_loop,
            self.receiver,
            layout,
            self.config.prefill_timeout_s,
            self.config.kv_transfer_timeout_s,
            parts.metrics,
            self.config.tls_files(),
        )
        telemetry = DecodeTelemetry(parts.metrics, parts.node_id, engine.spec_stats is not None)
        return DecodeServicer(
            parts.engine_loop,
            self.prefill_client,
            parts.node_id,
            parts.model,
            self.config.token_timeout_s,
            telemetry,
            parts.metrics_address,
            parts.model_version,
        )

    def add_servicer(self, servicer: DecodeServicer, server: grpc.aio.Server) -> None:
        node_pb2_grpc.add_DecodeNodeServicer_to_server(servicer, server)

    def describe(self) -> str:
        return f" (KV receiver {self.receiver.address})" if self.receiver else ""

    async def close(self) -> None:
        if self.prefill_client is not None:
            await self.prefill_client.close()
        if self.receiver is not None:
            await self.receiver.close()


def run(args: argparse.Namespace) -> int:
    role = DecodeRole(DecodeNodeConfig.from_cli_args(args))
    asyncio.run(serve_node(role, EngineArgs.from_cli_args(args)))
    return 0
