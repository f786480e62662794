"""`pdserve gateway`: the gateway process.

Its life: parse the config → load the tokenizer → poll the nodes → serve REST and gRPC →
wait for SIGTERM/SIGINT → drain (refuse new requests, let those in flight finish) → stop
the servers and close the node channels, whatever happened, in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from pdserve.common import tracing
from pdserve.engine.arg_utils import add_config_flags, config_field_docs
from pdserve.engine.platform import freeze_startup_objects
from pdserve.engine.tokenizer import Tokenizer, read_chat_template
from pdserve.gateway.admission import Admission
from pdserve.gateway.config import GatewayConfig, parse_address_list
from pdserve.gateway.context import GatewayContext
from pdserve.gateway.discovery import NodeDiscovery, Resolver, resolve_ips
from pdserve.gateway.generation import GenerationPipeline
from pdserve.gateway.grpc_front import GrpcFront
from pdserve.gateway.http_limits import deadline_protocol
from pdserve.gateway.logprobs import TokenTexts
from pdserve.gateway.lora import parse_lora_module
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import NodeRegistry
from pdserve.gateway.router import Router
from pdserve.gateway.server import build_app

logger = logging.getLogger("gateway")

_SERVER_STOP_GRACE_S = 1
"""After the drain, how long the servers give calls still open before cutting them."""

CONFIG_FLAGS = (
    "tokenizer",
    "chat_template",
    "host",
    "port",
    "grpc_port",
    "dns_refresh_s",
    "max_model_len",
    "max_num_requests",
    "request_timeout_s",
    "drain_timeout_s",
    "keep_alive_timeout_s",
    "header_timeout_s",
    "max_connections",
    "stall_timeout_s",
    "pooling",
    "enable_log_requests",
    "max_log_len",
    "max_request_body_bytes",
    "root_path",
    "allow_credentials",
    "ssl_keyfile",
    "ssl_certfile",
    "api_key",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "allow_runtime_lora_updating",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tls_server_name",
)
"""GatewayConfig fields whose flag is the field as it is (default and help: the field's)."""
_FLAG_HELP = {"grpc_port": "Public gRPC port (0 disables the gRPC front)."}
"""Where the flag's meaning differs from the field's docstring."""


def add_gateway_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: Iterable[str] = CONFIG_FLAGS
) -> None:
    """Flags for GatewayConfig fields of CONFIG_FLAGS (`pdserve serve` has some of them too)."""
    add_config_flags(parser, GatewayConfig, names, helps=_FLAG_HELP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags (vLLM's names where the meaning matches)."""
    docs = config_field_docs(GatewayConfig)
    parser.add_argument("--model", required=True, help=docs["model"])
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model ids clients may name (the first is the one /v1/models lists first and "
        "responses to unnamed requests carry); None: --model as given.",
    )
    parser.add_argument(
        "--decode-nodes",
        required=True,
        help="decode nodes, host:port,...; a DNS name (name:port or dns:///name:port) stands for "
        "every address it resolves to, re-resolved every --dns-refresh-s",
    )
    parser.add_argument(
        "--prefill-nodes",
        default="",
        help="prefill nodes, as --decode-nodes (empty: decode nodes prefill locally)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=[],
        help="CORS: origins browsers may call the REST API from, as JSON (vLLM's form), e.g. "
        "'[\"https://app.example.com\"]' or '[\"*\"]' (default: none, no CORS headers)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        help="LoRA adapters clients may name as models, vLLM's form: name=path or "
        '\'{"name": "sql", "path": "/adapters/sql"}\' (the nodes need --enable-lora)',
    )
    add_gateway_config_flags(parser)
    # SUPPRESS: under `pdserve gateway` the top-level --log-level must not be overwritten by
    # this sub-command's default.
    parser.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        help=f"logging level (DEBUG, INFO, ...; default {GatewayConfig.log_level})",
    )


def _log_level(args: argparse.Namespace) -> str:
    return getattr(args, "log_level", GatewayConfig.log_level)


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('expected a JSON list of strings, e.g. ["*"]')
    return value


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    plain = {name: getattr(args, name) for name in CONFIG_FLAGS}
    return GatewayConfig(
        model=args.model,
        served_model_name=(args.served_model_name or [args.model])[0],
        served_model_aliases=tuple((args.served_model_name or [])[1:]),
        decode_nodes=parse_address_list(args.decode_nodes),
        prefill_nodes=parse_address_list(args.prefill_nodes),
        lora_modules=tuple(getattr(args, "lora_modules", None) or ()),
        log_level=_log_level(args),
        **plain
        | {
            "grpc_port": args.grpc_port or None,
            "allowed_origins": tuple(args.allowed_origins),
            "api_key": args.api_key
            or os.environ.get("PDSERVE_API_KEY")
            or os.environ.get("VLLM_API_KEY"),
            "ssl_certfile": args.ssl_certfile or os.environ.get("PDSERVE_SSL_CERTFILE"),
            "ssl_keyfile": args.ssl_keyfile or os.environ.get("PDSERVE_SSL_KEYFILE"),
        },
    )


@dataclass(frozen=True)
class Listening:
    """Where the gateway ended up listening (ports chosen by the OS when 0 was asked for)."""

    rest_port: int
    grpc_port: int | None


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: serve() owns SIGTERM/SIGINT and drains first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RestServer:
    """uvicorn serving the FastAPI app on a socket bound here (a bind error is an OSError
    for the caller, not uvicorn's sys.exit)."""

    def __init__(self, app: object, config: GatewayConfig) -> None:
        host, port = config.host, config.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,  # type: ignore[arg-type]
            log_config=None,  # keep the process's logging
            log_level=config.log_level.lower(),
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=_SERVER_STOP_GRACE_S,
            timeout_keep_alive=config.keep_alive_timeout_s,
            root_path=config.root_path,
            http=deadline_protocol(config.header_timeout_s),
            limit_concurrency=config.max_connections,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
        )
        self._server = _UvicornServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the REST server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None and not self._task.done():
            await self._task
        self._socket.close()


def _public_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS (no client certificates) for the public gRPC port, from --ssl-keyfile/--ssl-certfile."""
    if not config.ssl_certfile or not config.ssl_keyfile:
        return None
    key = Path(config.ssl_keyfile).read_bytes()
    return grpc.ssl_server_credentials([(key, Path(config.ssl_certfile).read_bytes())])


async def serve(
    config: GatewayConfig,
    stop: asyncio.Event,
    on_listening: Callable[[Listening], None] | None = None,
    resolver: Resolver = resolve_ips,
) -> None:
    """Run the gateway until stop is set, then drain and shut down. resolver: how discovery
    resolves DNS names among the node entries."""
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
    if config.chat_template:
        tokenizer.set_chat_template(read_chat_template(config.chat_template))
    # Empty until discovery fills it from the entries (and keeps it up to date).
    registry = NodeRegistry(
        (), (), config.poll_interval_s, config.poll_timeout_s, config.tls_files()
    )
    discovery = NodeDiscovery(
        config.decode_nodes, config.prefill_nodes, config.dns_refresh_s, resolver
    )
    router = Router(registry)
    admission = Admission(config.max_num_requests)
    metrics = GatewayMetrics(config.served_model_name, lambda: admission.num_in_flight)
    ctx = GatewayContext(
        config=config,
        tokenizer=tokenizer,
        registry=registry,
        generator=GenerationPipeline(
            tokenizer, registry, router, metrics, stall_timeout_s=config.stall_timeout_s
        ),
        admission=admission,
        token_texts=TokenTexts(tokenizer),
        metrics=metrics,
    )
    rest: RestServer | None = None
    grpc_front: GrpcFront | None = None
    try:
        await discovery.start(registry)
        await registry.start()
        rest = RestServer(build_app(ctx), config)
        await rest.start()
        grpc_port = None
        if config.grpc_port is not None:
            grpc_front = GrpcFront(ctx, config.host, config.grpc_port, _public_credentials(config))
            grpc_port = await grpc_front.start()
        freeze_startup_objects()
        logger.info(
            "gateway for %r on %s: REST port %d, gRPC port %s; decode nodes %s, prefill nodes %s",
            config.served_model_name,
            config.host,
            rest.port,
            grpc_port,
            ",".join(config.decode_nodes),
            ",".join(config.prefill_nodes) or "none",
        )
        if on_listening is not None:
            on_listening(Listening(rest.port, grpc_port))
        await stop.wait()
        logger.info("draining %d requests in flight", admission.num_in_flight)
        if not await admission.drain(config.drain_timeout_s):
            logger.warning("%d requests still running after the drain", admission.num_in_flight)
    finally:
        if grpc_front is not None:
            await grpc_front.stop(_SERVER_STOP_GRACE_S)
        if rest is not None:
            await rest.stop()
        await discovery.close()
        await registry.close()
        logger.info("gateway stopped")


async def _serve_until_signalled(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)


def run(args: argparse.Namespace) -> int:
    """Run the gateway from parsed flags until SIGTERM/SIGINT; the process exit code."""
    try:
        config = config_from_args(args)
        logging.getLogger().setLevel(config.log_level.upper())
        tracing.setup("gateway", f"gateway-{socket.gethostname()}-{os.getpid()}")
        try:
            asyncio.run(_serve_until_signalled(config))
        finally:
            tracing.shutdown()  # flushes the last spans
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gateway", description="pdserve gateway: OpenAI REST + gRPC over decode nodes"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=GatewayConfig.log_level,  # run() applies --log-level once it is validated
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
