"""The nodes' configs: flags generated from the fields (defaults and help: the fields'),
validation, and build_engine from EngineArgs."""

from __future__ import annotations

import argparse

import pytest

from pdserve.common.node import build_engine
from pdserve.common.node_config import DecodeNodeConfig, NodeConfig, PrefillNodeConfig
from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.config import CacheConfig, SchedulerConfig


def parse(config: type[NodeConfig], *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    return p.parse_args(list(argv))


def test_flag_defaults_are_the_fields() -> None:
    prefill = PrefillNodeConfig.from_cli_args(parse(PrefillNodeConfig))
    assert prefill == PrefillNodeConfig()
    assert (prefill.port, prefill.prefill_timeout_s, prefill.drain_timeout_s) == (50071, 60.0, 30.0)
    decode = DecodeNodeConfig.from_cli_args(parse(DecodeNodeConfig))
    assert decode == DecodeNodeConfig()
    assert (decode.port, decode.kv_port, decode.token_timeout_s) == (50061, 0, 300.0)
    assert (decode.host, decode.kv_transport, decode.served_model_name) == (
        "127.0.0.1",
        "ucx",
        None,
    )


def test_flags_and_help() -> None:
    p = argparse.ArgumentParser()
    DecodeNodeConfig.add_cli_args(p)
    by_dest = {a.dest: a for a in p._actions}
    assert [s for a in p._actions for s in a.option_strings][2:] == [
        "--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name", "--host", "--port", "--served-model-name", "--num-threads", "--shared-cores-lock", "--node-id",
        "--kv-transport", "--metrics-port", "--metrics-host", "--drain-timeout-s", "--model-version",
        "--kv-host",
        "--kv-port", "--prefill-timeout-s", "--kv-transfer-timeout-s", "--token-timeout-s",
    ]  # fmt: skip
    assert by_dest["port"].help == "gRPC port (0 = any free)."  # the base's docstring
    assert by_dest["prefill_timeout_s"].help == "Deadline of one Prefill call on a prefill node."
    assert by_dest["kv_transport"].choices == ("ucx", "tcp")
    args = parse(DecodeNodeConfig, "--port", "1", "--num-threads", "2", "--kv-transport", "tcp")
    assert DecodeNodeConfig.from_cli_args(args) == DecodeNodeConfig(
        port=1, num_threads=2, kv_transport="tcp"
    )


@pytest.mark.parametrize(
    "config,setting,message",
    [
        (PrefillNodeConfig, {"port": 70000}, "port must be in"),
        (PrefillNodeConfig, {"metrics_port": -1}, "metrics_port must be in"),
        (PrefillNodeConfig, {"num_threads": 0}, "num_threads must be >= 1"),
        (PrefillNodeConfig, {"kv_transport": "rdma"}, "kv_transport must be"),
        (PrefillNodeConfig, {"drain_timeout_s": -1.0}, "drain_timeout_s must be >= 0"),
        (PrefillNodeConfig, {"prefill_timeout_s": 0.0}, "prefill_timeout_s must be > 0"),
        (DecodeNodeConfig, {"kv_port": 65536}, "kv_port must be in"),
        (DecodeNodeConfig, {"tls_cert": "c.pem"}, "mutual TLS needs --tls-key, --tls-ca too"),
        (DecodeNodeConfig, {"tls_server_name": "x"}, "--tls-server-name needs --tls-cert"),
        (PrefillNodeConfig, {"kv_target_hosts": " "}, "--kv-target-hosts must be"),
        (DecodeNodeConfig, {"token_timeout_s": 0.0}, "token_timeout_s must be > 0"),
        (DecodeNodeConfig, {"kv_transfer_timeout_s": -1.0}, "kv_transfer_timeout_s must be > 0"),
    ],
)
def test_validation(config: type[NodeConfig], setting: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**setting)


def test_build_engine_takes_every_engine_setting(tiny_llama: str) -> None:
    engine_args = EngineArgs(
        model=tiny_llama,
        dtype="float32",
        block_size=32,
        num_blocks=24,
        max_num_seqs=3,
        scheduling_policy="priority",
        remote_prefill_min_tokens=8,
        max_remote_prefill_queue_tokens=64,
        speculative_config={"num_speculative_tokens": 2},
    )
    engine = build_engine(engine_args, DecodeNodeConfig())
    assert engine.cache_config == CacheConfig(block_size=32, num_blocks=24)
    assert engine.scheduler_config == SchedulerConfig(
        max_num_seqs=3,
        policy="priority",
        remote_prefill_min_tokens=8,
        max_remote_prefill_queue_tokens=64,
    )
    assert engine.spec_stats is not None
