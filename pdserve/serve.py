"""`pdserve serve`: the whole stack on one machine, as separate processes.

Starts N prefill nodes, M decode nodes and the gateway (each a `pdserve` sub-command in its own
process), waits until every node's gRPC health says SERVING and the gateway's /health is 200
(restarting the stack on fresh ports if a child dies on the way), logs the URLs, and on
Ctrl-C/SIGTERM stops everything (SIGTERM first so nodes drain, SIGKILL after a deadline).
Children die with this process even if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Engine flags forwarded to every node unchanged: (argparse dest, flag).
_ENGINE_FLAGS = [
    ("dtype", "--dtype"),
    ("block_size", "--block-size"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("max_model_len", "--max-model-len"),
    ("num_blocks", "--num-blocks"),
    ("kv_cache_memory", "--kv-cache-memory"),
    ("scheduling_policy", "--scheduling-policy"),
    ("seed", "--seed"),
    ("num_threads", "--num-threads"),
    ("kv_transport", "--kv-transport"),
    ("served_model_name", "--served-model-name"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--num-prefill", type=int, default=1, help="prefill node processes (0 = none)")
    p.add_argument("--num-decode", type=int, default=1, help="decode node processes (>= 1)")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (OpenAI REST)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port (0 = off)")
    p.add_argument(
        "--served-model-name", default=None, help="model id clients use (default: --model)"
    )
    p.add_argument(
        "--kv-transport", default="ucx", choices=["ucx", "tcp"], help="KV transport between nodes"
    )
    p.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=32,
        help="decode nodes prefill prompts with fewer uncached tokens locally",
    )
    p.add_argument(
        "--max-remote-prefill-queue-tokens",
        type=int,
        default=0,
        help="decode nodes prefill a prompt locally while they wait on prefill nodes for at least "
        "this many tokens and their own prefill backlog is shorter (0 = off; see `pdserve decode "
        "--help`)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding on the decode nodes, as JSON (see `pdserve decode --help`)",
    )
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch threads per node (default: all)"
    )
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="pin node k to CPU core k mod cores (with --num-threads 1: one core per node)",
    )
    p.add_argument(
        "--max-num-requests", type=int, default=1024, help="gateway admission limit (then 429)"
    )
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="deadline, per start attempt, for every node to be SERVING and /health to be 200",
    )
    p.add_argument(
        "--state-file",
        default=None,
        help="once healthy, write the processes (name, address, pid) here as JSON, for tools",
    )
    p.add_argument(
        "--node-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give every node a Prometheus /metrics port on 127.0.0.1 (the gateway lists them "
        "at /metrics/targets and in --state-file)",
    )
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="extra flag passed to every node, e.g. --node-arg=--speculative-config=... "
        "(repeatable)",
    )
    p.add_argument(
        "--prefill-node-arg",
        action="append",
        default=[],
        help="extra flag passed to prefill nodes only, after --node-arg (repeatable)",
    )
    p.add_argument(
        "--decode-node-arg",
        action="append",
        default=[],
        help="extra flag passed to decode nodes only, after --node-arg, e.g. "
        "--decode-node-arg=--max-num-batched-tokens=256 (repeatable)",
    )


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    address: str
    metrics_address: str
    """host:port of its Prometheus /metrics (the gateway: its HTTP port)."""


_START_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _pin(core: int):
    def setup() -> None:
        _die_with_parent()
        os.sched_setaffinity(0, {core})

    return setup


def _forwarded(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model]
    for dest, flag in _ENGINE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            argv += [flag, str(value)]
    if not args.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    return argv + list(args.node_arg)


def _spawn(name: str, argv: list[str], core: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", *argv]
    logger.info("starting %s: %s", name, " ".join(cmd[2:]))
    setup = _pin(core) if core is not None else _die_with_parent
    return subprocess.Popen(cmd, preexec_fn=setup)


def start_stack(args: argparse.Namespace) -> list[Child]:
    children: list[Child] = []
    cores = os.cpu_count() or 1
    node_argv = _forwarded(args)
    for role, count in (("prefill", args.num_prefill), ("decode", args.num_decode)):
        for i in range(count):
            port = free_port()
            argv = [role, *node_argv, "--port", str(port)]
            if role == "decode":
                argv += ["--remote-prefill-min-tokens", str(args.remote_prefill_min_tokens)]
                argv += [
                    "--max-remote-prefill-queue-tokens",
                    str(args.max_remote_prefill_queue_tokens),
                ]
                if args.speculative_config:
                    argv += ["--speculative-config", args.speculative_config]
            argv += args.decode_node_arg if role == "decode" else args.prefill_node_arg
            metrics_address = ""
            if args.node_metrics:
                metrics_port = free_port()
                argv += ["--metrics-port", str(metrics_port)]
                metrics_address = f"127.0.0.1:{metrics_port}"
            core = len(children) % cores if args.pin_cpus else None
            process = _spawn(f"{role}-{i}", argv, core)
            children.append(Child(f"{role}-{i}", process, f"127.0.0.1:{port}", metrics_address))
    prefill = ",".join(c.address for c in children if c.name.startswith("prefill"))
    decode = ",".join(c.address for c in children if c.name.startswith("decode"))
    gateway_argv = ["gateway", "--model", args.model, "--host", args.host]
    gateway_argv += ["--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    gateway_argv += ["--decode-nodes", decode, "--max-num-requests", str(args.max_num_requests)]
    if prefill:
        gateway_argv += ["--prefill-nodes", prefill]
    if args.served_model_name:
        gateway_argv += ["--served-model-name", args.served_model_name]
    if args.max_model_len:
        gateway_argv += ["--max-model-len", str(args.max_model_len)]
    gateway = _spawn("gateway", gateway_argv, None)
    address = f"{args.host}:{args.port}"
    children.append(Child("gateway", gateway, address, address))
    return children


class StartupDeath(RuntimeError):
    """A child exited before the stack was up (e.g. a port taken between pick and bind)."""


def _node_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(url: str, children: list[Child], timeout_s: float) -> None:
    """Until the gateway's /health is 200 and every node reports SERVING (gRPC health)."""
    deadline = time.monotonic() + timeout_s
    pending = [c for c in children if c.name != "gateway"]
    while time.monotonic() < deadline:
        dead = [c.name for c in children if c.process.poll() is not None]
        if dead:
            raise StartupDeath(f"{', '.join(dead)} exited during startup")
        pending = [c for c in pending if not _node_serving(c.address)]
        if not pending:
            try:
                with urllib.request.urlopen(url, timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def stop_stack(children: list[Child], timeout_s: float = 20.0) -> None:
    """SIGTERM everyone (gateway first, then nodes drain), SIGKILL what outlives the deadline."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in reversed(children):
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", child.name)
            child.process.kill()
            child.process.wait(5.0)


def run(args: argparse.Namespace) -> int:
    if args.num_decode < 1:
        raise ValueError("--num-decode must be >= 1")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    base = f"http://{host}:{args.port}"
    for attempt in range(1, _START_ATTEMPTS + 1):
        children = start_stack(args)
        try:
            wait_healthy(f"{base}/health", children, args.startup_timeout_s)
            break
        except StartupDeath as exc:
            # Ports are picked free, then bound by the children: another process can take one
            # in between. Start everything again on fresh ports.
            stop_stack(children)
            if attempt == _START_ATTEMPTS:
                raise
            logger.warning("%s; starting the stack again (attempt %d)", exc, attempt + 1)
        except BaseException:
            stop_stack(children)
            raise
    try:
        logger.info("pdserve is up: OpenAI REST %s/v1, gRPC %s:%d", base, host, args.grpc_port)
        logger.info("status page %s/dashboard, metrics %s/metrics", base, base)
        for child in children:
            logger.info("  %-10s %s (pid %d)", child.name, child.address, child.process.pid)
        if args.state_file:
            state = [
                {
                    "name": c.name,
                    "address": c.address,
                    "pid": c.process.pid,
                    "metrics_address": c.metrics_address,
                }
                for c in children
            ]
            Path(args.state_file).write_text(json.dumps(state, indent=2))
        reported: set[str] = set()
        while not stopping:
            # A dead node is routed around by the gateway; only the gateway's death ends us.
            for child in children:
                code = child.process.poll()
                if code is not None and child.name not in reported:
                    reported.add(child.name)
                    logger.error("%s exited with code %s", child.name, code)
                    if child.name == "gateway":
                        return 1
            time.sleep(0.2)
        logger.info("stopping")
        return 0
    finally:
        stop_stack(children)
