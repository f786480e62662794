"""`pdserve prefill`: a prefill node's life — parse config, build the engine, start the KV
sender and the gRPC server, serve until SIGTERM, drain, clean up."""

from __future__ import annotations

import argparse
import asyncio
import logging

from engine.engine_loop import EngineLoop
from kvtransfer.connector import KVPushConnector, kv_layout
from kvtransfer.transport import make_sender
from pdserve.node import (
    NodeServer,
    add_node_args,
    build_engine,
    drain,
    node_id,
    served_model_name,
    stop_event_on_signals,
)
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.servicer import PrefillServicer, end_after_first_token

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.cli import add_engine_args

    add_engine_args(p)
    add_node_args(p, default_port=50071)
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=60.0,
        help="deadline for one prompt's prefill and KV push",
    )


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = stop_event_on_signals(loop)
    model = served_model_name(args)
    engine = build_engine(args)
    engine_loop = EngineLoop(engine, loop, after_step=end_after_first_token)
    sender = make_sender(args.kv_transport)
    layout = kv_layout(model, engine.runner.kv_cache, engine.cache_config.block_size)
    connector = KVPushConnector(engine.runner.kv_cache, layout, sender, loop)
    engine.kv_connector = connector
    servicer = PrefillServicer(
        engine_loop, connector, node_id(args, "prefill"), model, args.prefill_timeout_s
    )
    service = node_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name
    server = NodeServer(args.host, args.port, [service])
    node_pb2_grpc.add_PrefillNodeServicer_to_server(servicer, server.server)
    engine_loop.start()
    try:
        await server.start()
        logger.info("prefill node %s serving %s on %s", servicer.node_id, model, server.address)
        await stop.wait()
        logger.info("draining")
        servicer.accepting = False
        await server.set_serving(False)
        await drain(engine_loop, args.drain_timeout_s, servicer.abort_all, "prefill")
    finally:
        servicer.abort_all()
        await server.stop(grace_s=2.0)
        engine_loop.stop()
        await sender.close()
        logger.info("prefill node stopped")


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
