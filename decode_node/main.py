"""`pdserve decode`: a decode node's life — parse config, build the engine, start the KV
receiver and the gRPC server, serve until SIGTERM, drain, clean up."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.common import tracing
from pdserve.common.node import (
    DecodeNodeConfig,
    NodeServer,
    build_engine,
    drain,
    node_id,
    served_model_name,
    start_metrics_server,
    stop_event_on_signals,
)
from pdserve.common.node_metrics import NodeMetrics
from pdserve.decode_node.prefill_client import PrefillClient
from pdserve.decode_node.servicer import DecodeServicer
from pdserve.decode_node.telemetry import DecodeTelemetry
from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.platform import freeze_startup_objects
from pdserve.kvtransfer.connector import kv_layout
from pdserve.kvtransfer.transport import make_receiver
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, decode=True)
    DecodeNodeConfig.add_cli_args(p)


async def serve(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    config = DecodeNodeConfig.from_cli_args(args)
    loop = asyncio.get_running_loop()
    stop = stop_event_on_signals(loop)
    model = served_model_name(config, engine_args)
    this_node = node_id(config, "decode")
    tracing.setup("decode", this_node)
    engine = build_engine(engine_args, config)
    metrics = NodeMetrics(engine, "decode", model, this_node)
    speculative = getattr(engine, "spec_stats", None) is not None
    telemetry = DecodeTelemetry(metrics, this_node, speculative)
    engine_loop = EngineLoop(engine, loop)
    receiver = make_receiver(args.kv_transport, host=args.kv_host, port=args.kv_port)
    await receiver.start()
    layout = kv_layout(model, engine.kv_cache, engine.cache_config.block_size)
    prefiller = PrefillClient(
        engine_loop, receiver, layout, args.prefill_timeout_s, args.kv_transfer_timeout_s, metrics
    )
    servicer = DecodeServicer(
        engine_loop, prefiller, this_node, model, config.token_timeout_s, telemetry
    )
    metrics_server = start_metrics_server(metrics.registry, config)
    servicer.metrics_address = metrics_server.address if metrics_server else ""
    service = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name
    server = NodeServer(config.host, config.port, [service])
    node_pb2_grpc.add_DecodeNodeServicer_to_server(servicer, server.server)
    freeze_startup_objects()
    engine_loop.start()
    try:
        await server.start()
        logger.info(
            "decode node %s serving %s on %s (KV receiver %s)",
            servicer.node_id,
            model,
            server.address,
            receiver.address,
        )
        await stop.wait()
        logger.info("draining")
        servicer.accepting = False
        await server.set_serving(False)
        await drain(engine_loop, config.drain_timeout_s, servicer.abort_all, "decode")
    finally:
        servicer.abort_all()
        await server.stop(grace_s=2.0)
        engine_loop.stop()
        await prefiller.close()
        await receiver.close()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()  # flushes this node's last spans
        logger.info("decode node stopped")


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
