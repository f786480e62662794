"""The node processes' settings besides the engine's (EngineArgs): `NodeConfig` and one subclass per
role, their flags generated from the fields (default and help: the field's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, Self

from pdserve.common.tls import InternalTLSConfig
from pdserve.engine.arg_utils import add_config_flags, config_from_namespace


@dataclass(frozen=True)
class NodeConfig(InternalTLSConfig):
    """What every node process is told at start besides the engine's settings (EngineArgs):
    the flags of `pdserve prefill` and `pdserve decode` (add_cli_args)."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds."""
    port: int = 0
    """gRPC port (0 = any free)."""
    served_model_name: str | None = None
    """Model id reported to the gateway and in KV layouts; None: --model as given."""
    num_threads: int | None = None
    """Torch threads for the forward pass; None: torch's choice, all cores."""
    shared_cores_lock: str | None = None
    """Lock file of the nodes that compute on the same cores (`pdserve serve` sets it when two
    or more of its nodes each compute on every core): each engine step holds it, so the nodes
    take turns, a step at a time with every core, instead of oversubscribing the cores. None:
    no turns."""
    node_id: str | None = None
    """Stable node id; None: role-host-pid-random."""
    kv_transport: Literal["ucx", "tcp"] = "ucx"
    """KV block transport between prefill and decode nodes (ucx via ucxx, tcp fallback)."""
    metrics_port: int = 0
    """Port of the node's Prometheus /metrics (0 = off)."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics server binds."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before being aborted."""
    model_version: str | None = None
    """Version label of the weights served (rolling updates: KV moves only between nodes of
    one version; responses carry it as system_fingerprint); None: a fingerprint of the
    checkpoint's files."""

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_transport not in ("ucx", "tcp"):
            raise ValueError(f"kv_transport must be 'ucx' or 'tcp', got {self.kv_transport!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        self.tls_files()  # all three TLS files or none, readable

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (default and help: the field's)."""
        add_config_flags(parser.add_argument_group("node"), cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Self:
        return config_from_namespace(cls, args)


@dataclass(frozen=True)
class PrefillNodeConfig(NodeConfig):
    """A prefill node's settings (`pdserve prefill`)."""

    port: int = 50071
    prefill_timeout_s: float = 60.0
    """Deadline for one prompt's prefill and KV push."""
    kv_target_hosts: str = "caller"
    """Where this node pushes KV: "caller" (only to the host the Prefill call came from: the
    decode node that will hold the KV), "any" (behind a proxy that hides the caller's
    address), or a comma-separated list of allowed hosts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "prefill_timeout_s")
        if not self.kv_target_hosts.strip():
            raise ValueError('--kv-target-hosts must be "caller", "any" or a list of hosts')


@dataclass(frozen=True)
class DecodeNodeConfig(NodeConfig):
    """A decode node's settings (`pdserve decode`); the engine's decode-role settings (remote
    prefill, speculative decoding) are EngineArgs'."""

    port: int = 50061
    kv_host: str = "127.0.0.1"
    """Address of the KV receiver, given to prefill nodes (and bound, tcp transport); 0.0.0.0
    binds every interface and gives this host's address (a container's, a pod's)."""
    kv_port: int = 0
    """KV receiver port (0 = any free)."""
    prefill_timeout_s: float = 60.0
    """Deadline of one Prefill call on a prefill node."""
    kv_transfer_timeout_s: float = 10.0
    """How long to wait for the KV blocks after the prefill node answered."""
    token_timeout_s: float = 300.0
    """Longest gap between two tokens of a request before it fails."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_port("kv_port", self.kv_port)
        for name in ("prefill_timeout_s", "kv_transfer_timeout_s", "token_timeout_s"):
            _check_positive(self, name)


def _check_port(name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")


def _check_positive(config: NodeConfig, name: str) -> None:
    if getattr(config, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")
