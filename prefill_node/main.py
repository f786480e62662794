"""`pdserve prefill`: a prefill node's life — parse config, build the engine, start the KV
sender and the gRPC server, serve until SIGTERM, drain, clean up."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.common import tracing
from pdserve.common.node import (
    NodeServer,
    PrefillNodeConfig,
    build_engine,
    drain,
    node_id,
    served_model_name,
    start_metrics_server,
    stop_event_on_signals,
)
from pdserve.common.node_metrics import NodeMetrics
from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.platform import freeze_startup_objects
from pdserve.kvtransfer.connector import KVPushConnector
from pdserve.kvtransfer.transport import make_sender
from pdserve.prefill_node.servicer import PrefillServicer
from pdserve.prefill_node.telemetry import PrefillTelemetry
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    PrefillNodeConfig.add_cli_args(p)


async def serve(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    config = PrefillNodeConfig.from_cli_args(args)
    loop = asyncio.get_running_loop()
    stop = stop_event_on_signals(loop)
    model = served_model_name(config, engine_args)
    this_node = node_id(config, "prefill")
    tracing.setup("prefill", this_node)
    sender = make_sender(args.kv_transport)
    connector = KVPushConnector(model, sender, loop)
    engine = build_engine(engine_args, config, kv_connector=connector)
    metrics = NodeMetrics(engine, "prefill", model, this_node)
    telemetry = PrefillTelemetry(metrics, this_node)
    engine_loop = EngineLoop(engine, loop)
    servicer = PrefillServicer(
        engine_loop, connector, this_node, model, config.prefill_timeout_s, telemetry
    )
    metrics_server = start_metrics_server(metrics.registry, config)
    servicer.metrics_address = metrics_server.address if metrics_server else ""
    service = node_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name
    server = NodeServer(config.host, config.port, [service])
    node_pb2_grpc.add_PrefillNodeServicer_to_server(servicer, server.server)
    freeze_startup_objects()
    engine_loop.start()
    try:
        await server.start()
        logger.info("prefill node %s serving %s on %s", servicer.node_id, model, server.address)
        await stop.wait()
        logger.info("draining")
        servicer.accepting = False
        await server.set_serving(False)
        await drain(engine_loop, config.drain_timeout_s, servicer.abort_all, "prefill")
    finally:
        servicer.abort_all()
        await server.stop(grace_s=2.0)
        engine_loop.stop()
        await sender.close()
        if metrics_server is not None:
            metrics_server.stop()
        tracing.shutdown()  # flushes this node's last spans
        logger.info("prefill node stopped")


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
