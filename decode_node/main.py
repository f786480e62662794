"""`pdserve decode`: a decode node's life — parse config, build the engine, start the KV
receiver and the gRPC server, serve until SIGTERM, drain, clean up."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.common import tracing
from pdserve.common.node import (
    NodeServer,
    add_node_args,
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
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.platform import freeze_startup_objects
from pdserve.kvtransfer.connector import kv_layout
from pdserve.kvtransfer.transport import make_receiver
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.cli import add_engine_args

    add_engine_args(p)
    add_node_args(p, default_port=50061)
    p.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=32,
        help="prompts with fewer uncached tokens than this prefill locally (conditional "
        "disaggregation); longer ones go to a prefill node when the gateway offers one",
    )
    p.add_argument(
        "--max-remote-prefill-queue-tokens",
        type=int,
        default=0,
        help="queue-aware conditional disaggregation (0 = off): once this node waits on prefill "
        "nodes for at least this many prompt tokens, a new prompt prefills locally when the "
        "local prefill backlog, it included, is no longer than the remote one (pair with a small "
        "--max-num-batched-tokens to bound what a local prefill chunk adds to inter-token latency)",
    )
    p.add_argument(
        "--speculative-config",
        type=SpeculativeConfig.from_json,
        default=None,
        help='speculative decoding as JSON, like vLLM\'s: \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}\' or '
        '\'{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 3}\' '
        "(policy thresholds too: max_batch_for_speculation, min_expected_accepted, backoff_steps)",
    )
    p.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address of the KV receiver, given to prefill nodes (and bound, tcp transport); "
        "0.0.0.0 binds every interface and gives this host's address (a container's, a pod's)",
    )
    p.add_argument("--kv-port", type=int, default=0, help="KV receiver port (0 = any free)")
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=60.0,
        help="deadline of one Prefill call on a prefill node",
    )
    p.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=10.0,
        help="how long to wait for the KV blocks after the prefill node answered",
    )
    p.add_argument(
        "--token-timeout-s",
        type=float,
        default=300.0,
        help="longest gap between two tokens of a request before it fails",
    )


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = stop_event_on_signals(loop)
    model = served_model_name(args)
    this_node = node_id(args, "decode")
    tracing.setup("decode", this_node)
    engine = build_engine(
        args,
        remote_prefill_min_tokens=args.remote_prefill_min_tokens,
        max_remote_prefill_queue_tokens=args.max_remote_prefill_queue_tokens,
        speculative_config=args.speculative_config,
    )
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
        engine_loop, prefiller, this_node, model, args.token_timeout_s, telemetry
    )
    metrics_server = start_metrics_server(metrics.registry, args)
    servicer.metrics_address = metrics_server.address if metrics_server else ""
    service = node_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name
    server = NodeServer(args.host, args.port, [service])
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
        await drain(engine_loop, args.drain_timeout_s, servicer.abort_all, "decode")
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
