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
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common.node_config import NodeConfig
from pdserve.common.tls import TLSFiles, sync_channel
from pdserve.engine.arg_utils import EngineArgs, add_config_flags, config_argv, flag_argv
from pdserve.engine.config import SchedulerConfig
from pdserve.gateway.lora import parse_lora_module
from pdserve.gateway.main import add_gateway_config_flags

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_NODE_FLAGS = ("num_threads", "kv_transport")
"""NodeConfig fields that are flags of `serve` too, passed on to every node."""
_TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")
"""NodeConfig's mutual-TLS fields: flags of `serve` too, passed on to every node and the
gateway."""
_GATEWAY_FLAGS = ("host", "port", "grpc_port", "max_num_requests")
"""GatewayConfig fields that are flags of `serve` too, passed on to the gateway."""
_GATEWAY_OPTIONAL_FLAGS = (
    "chat_template",
    "ssl_keyfile",
    "ssl_certfile",
    "api_key",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "allow_runtime_lora_updating",
)
"""GatewayConfig fields that are flags of `serve` too, passed on only when set."""


AGGREGATED_MAX_NUM_BATCHED_TOKENS = 512
"""The step token budget of decode nodes that prefill every prompt themselves (a stack with
--num-prefill 0) when --max-num-batched-tokens is not given. Prompts then arrive in 512-token
chunks between decode steps instead of 2048-token ones: 40 prompts of 256 tokens, 64 out, 8 in
flight (SmolLM2, fp32, 2 cores) kept the same output throughput (76-81 tok/s) at a TTFT median
of 1.3 s instead of 3.3 s: requests that arrive together no longer all wait for the one step
that prefills them all (README, "Serving SmolLM2"; benchmarks/prefill_chunk_size.py for the
trade-off per budget). Prefill nodes, decode nodes fed by them, and engines without chunked
prefill (whose budget bounds the prompt) keep the engine's 2048."""


AGGREGATED_MAX_PREFILL_TOKENS_WHILE_DECODING = 96
"""The prompt tokens a step of such a decode node computes beside decodes, when
--max-prefill-tokens-while-decoding is not given: a prompt then rides on the others' decode
steps in chunks of 96 instead of stalling them for a 512-token step. Issue 17's workload
(SmolLM2 bf16, 256 in / 64 out, 8 in flight, 2 cores): TTFT p50 ~590 -> ~345 ms, p99 ITL
~340 -> ~95 ms, output throughput within the run-to-run spread (README,
"Zen 4, session 43"). --max-prefill-tokens-while-decoding 512 (the budget) turns it off."""


def _budget_per_role(p: argparse.ArgumentParser) -> None:
    """--max-num-batched-tokens left out sets nothing (node_argv then picks per role)."""
    for action in p._actions:  # argparse keeps no public handle on an added flag
        if action.dest == "max_num_batched_tokens":
            action.default = argparse.SUPPRESS
            action.help = (
                f"{action.help} (default: {AGGREGATED_MAX_NUM_BATCHED_TOKENS} on decode nodes "
                "when --num-prefill is 0 and chunked prefill is on, else "
                f"{SchedulerConfig.max_num_batched_tokens})"
            )
        if action.dest == "max_prefill_tokens_while_decoding":
            action.default = argparse.SUPPRESS
            action.help = (
                f"{action.help} (default: {AGGREGATED_MAX_PREFILL_TOKENS_WHILE_DECODING} on "
                "decode nodes when --num-prefill is 0 and chunked prefill is on, else no cap)"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, decode=True)
    _budget_per_role(p)
    nodes = p.add_argument_group("nodes")
    add_config_flags(nodes, NodeConfig, _NODE_FLAGS + _TLS_FLAGS)
    nodes.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model ids clients may name, as vLLM's (the nodes report the first; the gateway "
        "answers to all); None: --model as given",
    )
    add_gateway_config_flags(
        p.add_argument_group("gateway"), _GATEWAY_FLAGS + _GATEWAY_OPTIONAL_FLAGS
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        help="LoRA adapters clients may name as models (name=path or vLLM's JSON form), passed "
        "to the gateway; the nodes need --enable-lora",
    )
    p.add_argument("--num-prefill", type=int, default=1, help="prefill node processes (0 = none)")
    p.add_argument("--num-decode", type=int, default=1, help="decode node processes (>= 1)")
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="pin node k to CPU core k mod cores (with --num-threads 1: one core per node)",
    )
    p.add_argument(
        "--core-turns",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where two or more nodes each compute on every core (--num-threads left out, or "
        "as many as the cores) and --pin-cpus is off, the "
        "nodes take turns on the cores, one engine step at a time with every core (a shared "
        "lock file; README, 'Turns on shared cores'), instead of computing at once on "
        "oversubscribed cores; their prefill nodes then take the aggregated node's "
        f"{AGGREGATED_MAX_NUM_BATCHED_TOKENS}-token budget unless --max-num-batched-tokens is "
        "given. --no-core-turns: let the OS share the cores",
    )
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="deadline, per start attempt, for every node to be SERVING and /health to be 200",
    )
    p.add_argument(
        "--roll-drain-timeout-s",
        type=float,
        default=60.0,
        help="rolling update (SIGHUP): how long each node may take to drain before it is killed",
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
        help="extra flag passed to every node, e.g. --node-arg=--drain-timeout-s=5 (repeatable)",
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
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra flag passed to the gateway, after the ones serve gives it, e.g. "
        "--gateway-arg=--request-timeout-s=60 (repeatable)",
    )


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    address: str
    metrics_address: str
    """host:port of its Prometheus /metrics (the gateway: its HTTP port)."""
    argv: list[str] = field(default_factory=list)
    """How it was started (a rolling update starts it again the same way)."""
    core: int | None = None
    kernel_pool: bool = False
    """Whether its kernels' pool may spin inside its steps (child_env; kept for a restart)."""


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


def node_argv(
    args: argparse.Namespace,
    role: str,
    port: int,
    metrics_port: int | None,
    turns_lock: str | None = None,
) -> list[str]:
    """The `pdserve` argv of one node: serve's engine and node flags, then --node-arg, its port,
    then --prefill-node-arg or --decode-node-arg (the last of a repeated flag wins).
    turns_lock: the lock file the stack's nodes take turns on (run()), None without turns."""
    decode = role == "decode"
    argv = ["--log-level", args.log_level, role]
    argv += EngineArgs.from_cli_args(args).to_argv(decode=decode)
    local_prefill = decode and args.num_prefill == 0 and args.enable_chunked_prefill
    small_chunks = local_prefill or (not decode and turns_lock is not None)
    if small_chunks and not hasattr(args, "max_num_batched_tokens"):
        argv += flag_argv("max_num_batched_tokens", AGGREGATED_MAX_NUM_BATCHED_TOKENS)
    if local_prefill and not hasattr(args, "max_prefill_tokens_while_decoding"):
        argv += flag_argv(
            "max_prefill_tokens_while_decoding", AGGREGATED_MAX_PREFILL_TOKENS_WHILE_DECODING
        )
    names = _NODE_FLAGS + _TLS_FLAGS
    fields = {name: getattr(args, name) for name in names}
    fields["shared_cores_lock"] = turns_lock
    if args.served_model_name:
        fields["served_model_name"] = args.served_model_name[0]
    argv += config_argv(NodeConfig(**fields))
    argv += [*args.node_arg, "--port", str(port)]
    argv += args.decode_node_arg if decode else args.prefill_node_arg
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return argv


def gateway_argv(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> list[str]:
    """The `pdserve` argv of the gateway over these node addresses, then --gateway-arg."""
    argv = ["--log-level", args.log_level, "gateway", *flag_argv("model", args.model)]
    for name in _GATEWAY_FLAGS:
        argv += flag_argv(name, getattr(args, name))
    argv += flag_argv("decode_nodes", ",".join(decode))
    if prefill:
        argv += flag_argv("prefill_nodes", ",".join(prefill))
    if args.served_model_name:
        argv += ["--served-model-name", *args.served_model_name]
    if args.lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in args.lora_modules)]
    if args.max_model_len:
        argv += flag_argv("max_model_len", args.max_model_len)
    for name in ("tokenizer", *_GATEWAY_OPTIONAL_FLAGS, *_TLS_FLAGS):
        if getattr(args, name):
            argv += flag_argv(name, getattr(args, name))
    return argv + args.gateway_arg


def child_env(kernel_pool: bool) -> dict[str, str]:
    """The children's environment: OMP_WAIT_POLICY=PASSIVE unless the caller chose a policy
    (OMP_WAIT_POLICY, or libgomp's GOMP_SPINCOUNT), and PDSERVE_KERNEL_POOL=1 if kernel_pool
    (unless the caller set it).
    serve's processes share the machine's cores, and an OpenMP thread that spins while
    waiting for work (libgomp's default) takes a core from the process that has work: with two
    nodes on two cores, a spinning idle node made the busy one up to ~10x slower
    (benchmarks/results/prefill_long_prompts_spinwait_*.json). But a sleeping thread costs a
    wake-up at each of a decode step's ~180 parallel loops, so where the nodes' threads fit the
    cores the CPU kernels run their loops on their own pool instead, spinning inside a step
    only (pdserve_kernels/cpu/thread_pool.h)."""
    env = dict(os.environ)
    if "GOMP_SPINCOUNT" not in env:  # a chosen spin count is a policy too
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("PDSERVE_KERNEL_POOL", "1" if kernel_pool else "0")
    return env


def threads_fit_cores(args: argparse.Namespace) -> bool:
    """Whether the nodes' compute threads together fit this process's CPUs (a node without
    --num-threads takes torch's default, one per core), so a node's idle kernel workers may
    spin inside its steps without taking a core another node computes on."""
    cores = len(os.sched_getaffinity(0))
    nodes = args.num_prefill + args.num_decode
    return nodes * (args.num_threads or cores) <= cores


def takes_core_turns(args: argparse.Namespace) -> bool:
    """Whether serve's nodes take turns on the cores (engine/core_turns.py): --core-turns, two
    or more nodes, not pinned, each computing on every core (a node without --num-threads takes
    one thread per core). Nodes of fewer threads each keep computing side by side: one at a time
    would leave cores idle."""
    nodes = args.num_prefill + args.num_decode
    cores = len(os.sched_getaffinity(0))
    threads = args.num_threads or cores
    return args.core_turns and not args.pin_cpus and nodes > 1 and threads >= cores


def _spawn(
    name: str, argv: list[str], core: int | None, kernel_pool: bool = False
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", *argv]
    logger.info("starting %s: %s", name, " ".join(cmd[2:]))
    setup = _pin(core) if core is not None else _die_with_parent
    return subprocess.Popen(cmd, preexec_fn=setup, env=child_env(kernel_pool))


def start_stack(args: argparse.Namespace, turns_lock: str | None = None) -> list[Child]:
    """Every node, then the gateway; turns_lock as node_argv's."""
    children: list[Child] = []
    cores = os.cpu_count() or 1
    for role, count in (("prefill", args.num_prefill), ("decode", args.num_decode)):
        for i in range(count):
            port = free_port()
            metrics_port = free_port() if args.node_metrics else None
            argv = node_argv(args, role, port, metrics_port, turns_lock)
            core = len(children) % cores if args.pin_cpus else None
            # A node's kernel pool spins inside its steps only: with turns, a step has every core.
            pool = threads_fit_cores(args) or turns_lock is not None
            process = _spawn(f"{role}-{i}", argv, core, pool)
            metrics_address = f"127.0.0.1:{metrics_port}" if metrics_port else ""
            children.append(
                Child(
                    f"{role}-{i}", process, f"127.0.0.1:{port}", metrics_address, argv, core, pool
                )
            )
    prefill = [c.address for c in children if c.name.startswith("prefill")]
    decode = [c.address for c in children if c.name.startswith("decode")]
    gateway = _spawn("gateway", gateway_argv(args, prefill, decode), None)
    address = f"{args.host}:{args.port}"
    children.append(Child("gateway", gateway, address, address))
    return children


class StartupDeath(RuntimeError):
    """A child exited before the stack was up (e.g. a port taken between pick and bind)."""


REFUSED_EXIT_CODE = 2
"""A child's exit code for flags or a model it refuses (pdserve.cli: argparse errors and
ValueErrors, whose one line the child logged): starting it again cannot help."""


def _node_serving(address: str, tls: TLSFiles | None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(
    url: str, children: list[Child], timeout_s: float, tls: TLSFiles | None = None
) -> None:
    """Until every node reports SERVING (gRPC health; over mutual TLS when tls is given) and
    the gateway's /health is 200 with status "ok": it has seen every node accepting (so the
    first requests already find the prefill tier). An https url is checked without verifying
    the gateway's certificate: it is our own child, on the address we gave it."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    deadline = time.monotonic() + timeout_s
    pending = [c for c in children if c.name != "gateway"]
    while time.monotonic() < deadline:
        dead = [c for c in children if c.process.poll() is not None]
        refused = [c.name for c in dead if c.process.returncode == REFUSED_EXIT_CODE]
        if refused:
            raise ValueError(f"{', '.join(refused)} refused to start (its error is above)")
        if dead:
            raise StartupDeath(f"{', '.join(c.name for c in dead)} exited during startup")
        pending = [c for c in pending if not _node_serving(c.address, tls)]
        if not pending:
            try:
                with urllib.request.urlopen(url, timeout=2.0, context=context) as response:
                    if response.status == 200 and json.load(response).get("status") == "ok":
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


_ROLL_SETTLE_S = 2.0
"""After a restarted node serves, how long before the next one drains: the gateway polls
nodes every 0.5 s and must see the new one accepting first, so some node always takes work."""


def roll_nodes(
    children: list[Child],
    args: argparse.Namespace,
    tls: TLSFiles | None,
    stopping: Callable[[], bool] = lambda: False,
) -> bool:
    """A rolling update (SIGHUP): every node in turn, prefill nodes first, drains (SIGTERM:
    it refuses new work, finishes what it has, exits) and starts again with the same flags on
    the same port, reading --model afresh (point a symlink at new weights, then SIGHUP). The
    gateway routes around the node while it is away and keeps each request on one model
    version. False if a node did not come back or serve is stopping (the roll stops there)."""
    nodes = [c for c in children if c.name != "gateway"]
    nodes.sort(key=lambda c: not c.name.startswith("prefill"))
    for child in nodes:
        if stopping():
            return False
        logger.info("rolling update: draining %s", child.name)
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(args.roll_drain_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not drain in time; killing it", child.name)
            child.process.kill()
            child.process.wait(5.0)
        child.process = _spawn(child.name, child.argv, child.core, child.kernel_pool)
        deadline = time.monotonic() + args.startup_timeout_s
        while not _node_serving(child.address, tls):
            if child.process.poll() is not None or time.monotonic() > deadline:
                logger.error("rolling update: %s did not come back; stopping the roll", child.name)
                return False
            time.sleep(0.25)
        logger.info("rolling update: %s serving again (pid %d)", child.name, child.process.pid)
        time.sleep(_ROLL_SETTLE_S)
    logger.info("rolling update: every node restarted")
    return True


def _write_state(path: str, children: list[Child]) -> None:
    state = [
        {
            "name": c.name,
            "address": c.address,
            "pid": c.process.pid,
            "metrics_address": c.metrics_address,
        }
        for c in children
    ]
    Path(path).write_text(json.dumps(state, indent=2))


def _prepare_model(model: str, tokenizer: str | None) -> None:
    """Resolve --model here, before any child starts: a GGUF file is converted once (every node
    and the gateway then load the cached directory), and a missing, truncated or corrupt file,
    an unsupported one, or a GGUF file without tokenizer metadata and no --tokenizer is one
    ValueError line with nothing started."""
    from pdserve.engine.models import gguf

    directory = gguf.model_dir(model)
    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"{model}: no config.json (a model directory or a .gguf file)")
    missing = None if tokenizer is not None else gguf.tokenizer_missing_message(directory)
    if missing is not None:
        raise ValueError(missing)


def _prepare_cpu_kernels() -> None:
    """Build the CPU kernels here, once, if this machine has no build for their key yet: nodes
    started after find it and import it (else every node would wait on the first one's
    compile under the build lock)."""
    from pdserve.kernels import cpu

    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0" or cpu.built_folder() is not None:
        return  # built (or off): nothing to do here, and no torch to import (~2.5 s)
    start = time.monotonic()
    ready = cpu.cpu_ops() is not None
    logger.debug(
        "CPU kernels %s in %.1fs", "ready" if ready else "unavailable", time.monotonic() - start
    )


def run(args: argparse.Namespace) -> int:
    if args.num_decode < 1:
        raise ValueError("--num-decode must be >= 1")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    scheme = "https" if args.ssl_certfile or os.environ.get("PDSERVE_SSL_CERTFILE") else "http"
    base = f"{scheme}://{host}:{args.port}"
    tls = NodeConfig(**{name: getattr(args, name) for name in _TLS_FLAGS}).tls_files()
    _prepare_model(args.model, args.tokenizer)
    _prepare_cpu_kernels()
    turns = takes_core_turns(args)
    turns_dir = tempfile.TemporaryDirectory(prefix="pdserve-cores-") if turns else None
    turns_lock = None
    if turns_dir is not None:
        turns_lock = os.path.join(turns_dir.name, "turn.lock")
        logger.info(
            "%d nodes share %d cores: they take turns, a step at a time (--no-core-turns: off)",
            args.num_prefill + args.num_decode,
            len(os.sched_getaffinity(0)),
        )
    try:
        return _run_stack(args, base, host, tls, turns_lock)
    finally:
        if turns_dir is not None:
            turns_dir.cleanup()


def _run_stack(
    args: argparse.Namespace, base: str, host: str, tls: TLSFiles | None, turns_lock: str | None
) -> int:
    stopping = False
    roll_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_hangup(signum: int, frame: object) -> None:
        nonlocal roll_requested
        roll_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    for attempt in range(1, _START_ATTEMPTS + 1):
        children = start_stack(args, turns_lock)
        try:
            wait_healthy(f"{base}/health", children, args.startup_timeout_s, tls)
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
            _write_state(args.state_file, children)
        reported: set[str] = set()
        while not stopping:
            if roll_requested:
                roll_requested = False
                roll_nodes(children, args, tls, lambda: stopping)
                reported.clear()
                if args.state_file:
                    _write_state(args.state_file, children)
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
