"""What `pdserve serve` tells each process it starts: the engine flags (EngineArgs.to_argv), the
node flags, --node-arg / --prefill-node-arg / --decode-node-arg, --gateway-arg, and the
top-level --log-level; each argv parses back, in `pdserve`'s own parser, to serve's settings."""

from __future__ import annotations

import argparse

import pytest

from pdserve import serve
from pdserve.cli import build_parser
from pdserve.common.node_config import DecodeNodeConfig, PrefillNodeConfig
from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.config import SpeculativeConfig
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.main import config_from_args

SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
SERVE = [
    "--log-level", "DEBUG", "serve", "--model", "models/tiny", "--block-size", "32",
    "--max-model-len", "256", "--remote-prefill-min-tokens", "1", "--speculative-config", SPEC,
    "--no-enable-prefix-caching", "--num-threads", "1", "--kv-transport", "tcp",
    "--served-model-name", "tiny", "alias", "--port", "8001", "--grpc-port", "0",
    "--node-arg=--drain-timeout-s=1", "--decode-node-arg=--max-num-seqs=4",
    "--prefill-node-arg=--prefill-timeout-s=9", "--gateway-arg=--request-timeout-s=5",
    "--gateway-arg=--dns-refresh-s=0",
]  # fmt: skip
ENGINE = [
    "--model=models/tiny", "--max-model-len=256", "--block-size=32", "--no-enable-prefix-caching",
]  # fmt: skip
NODE = ["--served-model-name=tiny", "--num-threads=1", "--kv-transport=tcp"]


@pytest.fixture
def args() -> argparse.Namespace:
    return build_parser().parse_args(SERVE)


def test_decode_node_argv(args: argparse.Namespace) -> None:
    argv = serve.node_argv(args, "decode", 7001, metrics_port=7002)
    assert argv == [
        "--log-level", "DEBUG", "decode", *ENGINE, "--remote-prefill-min-tokens=1",
        f"--speculative-config={SPEC}", *NODE, "--drain-timeout-s=1", "--port", "7001",
        "--max-num-seqs=4", "--metrics-port", "7002",
    ]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert parsed.log_level == "DEBUG"
    engine = EngineArgs.from_cli_args(parsed)
    assert engine == EngineArgs(
        model="models/tiny",
        max_model_len=256,
        block_size=32,
        enable_prefix_caching=False,
        max_num_seqs=4,  # --decode-node-arg
        remote_prefill_min_tokens=1,  # the decode flag's default is 32: passed on all the same
        speculative_config=SpeculativeConfig(num_speculative_tokens=2),
    )
    assert DecodeNodeConfig.from_cli_args(parsed) == DecodeNodeConfig(
        port=7001,
        served_model_name="tiny",
        num_threads=1,
        kv_transport="tcp",
        metrics_port=7002,
        drain_timeout_s=1.0,
    )


def test_prefill_node_argv_has_no_decode_flags(args: argparse.Namespace) -> None:
    argv = serve.node_argv(args, "prefill", 7003, metrics_port=None)
    assert argv == [
        "--log-level", "DEBUG", "prefill", *ENGINE, *NODE, "--drain-timeout-s=1",
        "--port", "7003", "--prefill-timeout-s=9",
    ]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert EngineArgs.from_cli_args(parsed) == EngineArgs(
        model="models/tiny", max_model_len=256, block_size=32, enable_prefix_caching=False
    )
    assert PrefillNodeConfig.from_cli_args(parsed) == PrefillNodeConfig(
        port=7003,
        served_model_name="tiny",
        num_threads=1,
        kv_transport="tcp",
        drain_timeout_s=1.0,
        prefill_timeout_s=9.0,
    )


def test_gateway_argv_passes_gateway_args_and_the_log_level(args: argparse.Namespace) -> None:
    argv = serve.gateway_argv(args, ["127.0.0.1:7003"], ["127.0.0.1:7001", "127.0.0.1:7004"])
    assert argv == [
        "--log-level", "DEBUG", "gateway", "--model=models/tiny", "--host=127.0.0.1",
        "--port=8001", "--grpc-port=0", "--max-num-requests=1024",
        "--decode-nodes=127.0.0.1:7001,127.0.0.1:7004", "--prefill-nodes=127.0.0.1:7003",
        "--served-model-name", "tiny", "alias", "--max-model-len=256",
        "--request-timeout-s=5", "--dns-refresh-s=0",
    ]  # fmt: skip
    assert config_from_args(build_parser().parse_args(argv)) == GatewayConfig(
        model="models/tiny",
        served_model_name="tiny",
        served_model_aliases=("alias",),
        decode_nodes=("127.0.0.1:7001", "127.0.0.1:7004"),
        prefill_nodes=("127.0.0.1:7003",),
        port=8001,
        grpc_port=None,
        max_model_len=256,
        request_timeout_s=5.0,
        dns_refresh_s=0.0,
        log_level="DEBUG",
    )


def test_defaults_pass_only_model_and_log_level() -> None:
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert serve.node_argv(args, "decode", 7001, None) == [
        "--log-level", "INFO", "decode", "--model=m", "--port", "7001",
    ]  # fmt: skip
    assert serve.gateway_argv(args, [], ["127.0.0.1:7001"]) == [
        "--log-level", "INFO", "gateway", "--model=m", "--host=127.0.0.1", "--port=8000",
        "--grpc-port=50051", "--max-num-requests=1024", "--decode-nodes=127.0.0.1:7001",
    ]  # fmt: skip


def _node_budget(serve_flags: list[str], role: str = "decode") -> int:
    """The step token budget the node of `role` gets from `pdserve serve` with these flags."""
    args = build_parser().parse_args(["serve", "--model", "m", *serve_flags])
    argv = serve.node_argv(args, role, 7001, None)
    return EngineArgs.from_cli_args(build_parser().parse_args(argv)).max_num_batched_tokens


def test_token_budget_per_role() -> None:
    aggregated = serve.AGGREGATED_MAX_NUM_BATCHED_TOKENS
    assert aggregated < 2048
    # a decode node that prefills every prompt itself takes the smaller budget by default
    assert _node_budget(["--num-prefill", "0"]) == aggregated
    # ... unless told otherwise, by --max-num-batched-tokens (even its engine default) or by
    # --decode-node-arg (after it: the last flag wins)
    assert _node_budget(["--num-prefill", "0", "--max-num-batched-tokens", "2048"]) == 2048
    assert _node_budget(["--num-prefill", "0", "--max-num-batched-tokens", "300"]) == 300
    flag = "--decode-node-arg=--max-num-batched-tokens=256"
    assert _node_budget(["--num-prefill", "0", flag]) == 256
    # without chunked prefill the budget bounds the prompt: the engine's default stays
    assert _node_budget(["--num-prefill", "0", "--no-enable-chunked-prefill"]) == 2048
    # prefill nodes and the decode nodes they feed keep the engine's default
    assert _node_budget([]) == 2048
    assert _node_budget([], role="prefill") == 2048
    assert _node_budget(["--max-num-batched-tokens", "4096"], role="prefill") == 4096


def _node_prefill_cap(serve_flags: list[str], role: str = "decode") -> int | None:
    """The prefill cap beside decodes the node of `role` gets from `pdserve serve`."""
    args = build_parser().parse_args(["serve", "--model", "m", *serve_flags])
    argv = serve.node_argv(args, role, 7001, None)
    return EngineArgs.from_cli_args(
        build_parser().parse_args(argv)
    ).max_prefill_tokens_while_decoding


def test_prefill_cap_while_decoding_per_role() -> None:
    cap = serve.AGGREGATED_MAX_PREFILL_TOKENS_WHILE_DECODING
    assert cap < serve.AGGREGATED_MAX_NUM_BATCHED_TOKENS
    # a decode node that prefills every prompt itself spreads prompts over the decode steps
    assert _node_prefill_cap(["--num-prefill", "0"]) == cap
    assert (
        _node_prefill_cap(["--num-prefill", "0", "--max-prefill-tokens-while-decoding", "512"])
        == 512
    )
    flag = "--decode-node-arg=--max-prefill-tokens-while-decoding=32"
    assert _node_prefill_cap(["--num-prefill", "0", flag]) == 32
    # without chunked prefill, on nodes fed by prefill nodes and on prefill nodes: no cap
    assert _node_prefill_cap(["--num-prefill", "0", "--no-enable-chunked-prefill"]) is None
    assert _node_prefill_cap([]) is None
    assert _node_prefill_cap([], role="prefill") is None
    assert _node_prefill_cap(["--max-prefill-tokens-while-decoding", "64"]) == 64


class _Process:
    """What start_stack and roll_nodes use of a child process (none is started)."""

    pid = 0

    def send_signal(self, signum: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def poll(self) -> int | None:
        return None


def test_start_stack_wires_the_addresses(
    args: argparse.Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: dict[str, list[str]] = {}
    pooled: dict[str, bool] = {}

    def spawn(name: str, argv: list[str], core: int | None, kernel_pool: bool = False) -> _Process:
        spawned[name], pooled[name] = argv, kernel_pool
        return _Process()

    ports = iter(range(7001, 7100))
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(ports))
    monkeypatch.setattr(serve, "_spawn", spawn)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})
    args.num_prefill, args.num_decode = 1, 2
    children = serve.start_stack(args)
    assert [(c.name, c.address, c.metrics_address) for c in children] == [
        ("prefill-0", "127.0.0.1:7001", "127.0.0.1:7002"),
        ("decode-0", "127.0.0.1:7003", "127.0.0.1:7004"),
        ("decode-1", "127.0.0.1:7005", "127.0.0.1:7006"),
        ("gateway", "127.0.0.1:8001", "127.0.0.1:8001"),
    ]
    assert spawned["decode-1"] == serve.node_argv(args, "decode", 7005, 7006)
    assert spawned["prefill-0"] == serve.node_argv(args, "prefill", 7001, 7002)
    gateway = build_parser().parse_args(spawned["gateway"])
    assert (gateway.decode_nodes, gateway.prefill_nodes) == (
        "127.0.0.1:7003,127.0.0.1:7005",
        "127.0.0.1:7001",
    )
    assert all(argv[:2] == ["--log-level", "DEBUG"] for argv in spawned.values())
    # 3 nodes of args.num_threads each on 2 CPUs: no spinning kernel pool anywhere
    assert not any(pooled.values())


def test_nodes_take_turns_where_their_threads_outnumber_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})

    def turns(*flags: str) -> bool:
        return serve.takes_core_turns(build_parser().parse_args(["serve", "--model", "m", *flags]))

    assert turns()  # serve's default 1 + 1, a thread per core each
    assert turns("--num-threads", "2") and turns("--num-prefill", "2", "--num-threads", "3")
    # one thread each: one node at a time would leave a core idle; the OS shares them
    assert not turns("--num-prefill", "2", "--num-threads", "1")
    assert not turns("--no-core-turns")
    assert not turns("--pin-cpus")  # each node on its own core: nothing to share
    assert not turns("--num-prefill", "0")  # one node
    assert not turns("--num-threads", "1")  # 1 + 1 threads on 2 cores fit


def test_turn_taking_nodes_get_the_lock_and_prefill_nodes_small_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parse = build_parser().parse_args
    args = parse(["serve", "--model", "m"])
    lock = "/tmp/pdserve-cores-x/turn.lock"  # what run() makes
    for role, config in (("prefill", PrefillNodeConfig), ("decode", DecodeNodeConfig)):
        node = config.from_cli_args(parse(serve.node_argv(args, role, 7001, None, lock)))
        assert node.shared_cores_lock == lock
    aggregated = serve.AGGREGATED_MAX_NUM_BATCHED_TOKENS
    budget = EngineArgs.from_cli_args(parse(serve.node_argv(args, "prefill", 7001, None, lock)))
    assert budget.max_num_batched_tokens == aggregated
    budget = EngineArgs.from_cli_args(parse(serve.node_argv(args, "decode", 7001, None, lock)))
    assert budget.max_num_batched_tokens == 2048  # fed by the prefill node, as before
    given = parse(["serve", "--model", "m", "--max-num-batched-tokens", "1024"])
    budget = EngineArgs.from_cli_args(parse(serve.node_argv(given, "prefill", 7001, None, lock)))
    assert budget.max_num_batched_tokens == 1024
    # without turns: no lock flag at all
    plain = parse(serve.node_argv(parse(["serve", "--model", "m"]), "decode", 7001, None))
    assert DecodeNodeConfig.from_cli_args(plain).shared_cores_lock is None
    # with turns a step has every core: the nodes' kernel pools may spin inside their steps
    pooled: dict[str, bool] = {}

    def spawn(name: str, argv: list[str], core: int | None, kernel_pool: bool = False) -> _Process:
        pooled[name] = kernel_pool
        return _Process()

    ports = iter(range(7001, 7100))
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(ports))
    monkeypatch.setattr(serve, "_spawn", spawn)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})
    children = serve.start_stack(args, lock)
    assert pooled == {"prefill-0": True, "decode-0": True, "gateway": False}
    # a rolling update starts each node again as it started: with its pool
    monkeypatch.setattr(serve, "_node_serving", lambda address, tls: True)
    pooled.clear()
    monkeypatch.setattr(serve, "_ROLL_SETTLE_S", 0.0)
    assert serve.roll_nodes(children, args, None)
    assert pooled == {"prefill-0": True, "decode-0": True}
