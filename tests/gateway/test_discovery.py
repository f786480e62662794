"""Node discovery: entries parsed, DNS names resolved to every address (through an injected
resolver), failures handled, and the registry following what discovery finds."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import pytest

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.discovery import NodeDiscovery, NodeEntry, format_address, resolve_ips
from pdserve.gateway.registry import NodeRegistry
from tests.gateway.fake_nodes import DecodeBehaviour, FakeDecodeNode, start_decode_node
from tests.gateway.harness import BackgroundLoop


@pytest.mark.parametrize(
    "entry,expected",
    [
        ("10.0.0.7:50061", NodeEntry("10.0.0.7", 50061, is_name=False)),
        ("[fd00::7]:50061", NodeEntry("fd00::7", 50061, is_name=False)),
        ("decode:50061", NodeEntry("decode", 50061, is_name=True)),
        ("dns:///pdserve-decode.ns.svc:50061", NodeEntry("pdserve-decode.ns.svc", 50061, True)),
        ("dns:///10.0.0.7:1", NodeEntry("10.0.0.7", 1, is_name=False)),
    ],
)
def test_entries_parse(entry: str, expected: NodeEntry) -> None:
    assert NodeEntry.parse(entry) == expected


@pytest.mark.parametrize(
    "entry,message",
    [
        ("nohost", "not host:port"),
        ("h:99999", "not host:port"),
        (":80", "not host:port"),
        ("dns://8.8.8.8/decode:1", "only the dns:/// scheme"),
        ("ipv4:10.0.0.1:1", "not host:port"),
    ],
)
def test_bad_entries(entry: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodeEntry.parse(entry)


def test_config_accepts_names_and_checks_the_refresh() -> None:
    config = GatewayConfig("m", "m", ("dns:///decode.ns.svc:50061",), ("prefill:50071",))
    assert config.dns_refresh_s == 2.0
    with pytest.raises(ValueError, match="dns_refresh_s"):
        GatewayConfig("m", "m", ("decode:1",), dns_refresh_s=-1)


def test_format_address() -> None:
    assert format_address("10.0.0.7", 5) == "10.0.0.7:5"
    assert format_address("fd00::7", 5) == "[fd00::7]:5"


def test_default_resolver_prefers_ipv4() -> None:
    assert asyncio.run(resolve_ips("localhost", 80)) == ["127.0.0.1"]


class FakeDns:
    """name -> IPs, or an exception to raise; records the lookups."""

    def __init__(self, records: dict[str, list[str] | BaseException]) -> None:
        self.records = records
        self.lookups: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.lookups.append((host, port))
        answer = self.records[host]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def addresses(discovery: NodeDiscovery, entries: Sequence[str]) -> list[str]:
    return asyncio.run(discovery.addresses(entries))


def test_names_become_every_address_they_resolve_to() -> None:
    dns = FakeDns({"decode": ["10.0.0.9", "10.0.0.2"], "other": ["10.0.0.2"]})
    discovery = NodeDiscovery(["decode:50061"], [], refresh_s=1.0, resolver=dns)
    entries = ["10.0.0.1:50061", "decode:50061", "other:50061"]
    # Entry order, each name's addresses sorted, duplicates once; IP literals not looked up.
    assert addresses(discovery, entries) == ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.9:50061"]
    assert dns.lookups == [("decode", 50061), ("other", 50061)]


def test_a_missing_name_is_no_nodes_and_a_failed_lookup_keeps_the_last_answer() -> None:
    dns = FakeDns({"decode": ["10.0.0.2"]})
    discovery = NodeDiscovery(["decode:1"], [], refresh_s=1.0, resolver=dns)
    assert addresses(discovery, ["decode:1"]) == ["10.0.0.2:1"]
    dns.records["decode"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    assert addresses(discovery, ["decode:1"]) == ["10.0.0.2:1"]
    dns.records["decode"] = TimeoutError()
    assert addresses(discovery, ["decode:1"]) == ["10.0.0.2:1"]
    dns.records["decode"] = socket.gaierror(socket.EAI_NONAME, "no such name")  # scaled to 0
    assert addresses(discovery, ["decode:1"]) == []
    dns.records["decode"] = ["10.0.0.3"]
    assert addresses(discovery, ["decode:1"]) == ["10.0.0.3:1"]


def test_no_refresh_means_entries_as_given() -> None:
    dns = FakeDns({})
    discovery = NodeDiscovery(["decode:1", "decode:1"], [], refresh_s=0, resolver=dns)
    assert addresses(discovery, ["decode:1", "decode:1", "10.0.0.1:2"]) == [
        "decode:1",
        "10.0.0.1:2",
    ]
    assert dns.lookups == [] and not discovery.dynamic


def test_registry_follows_discovery(bg_loop: BackgroundLoop, script: list[int]) -> None:
    """Nodes that appear are polled at once (routable when update_nodes returns); a removed node
    leaves the routing list at once but keeps its channel while streams are open on it."""
    nodes = [FakeDecodeNode(DecodeBehaviour(script=script)) for _ in range(2)]
    ports = [bg_loop.run(start_decode_node(node)) for node in nodes]
    a, b = (f"127.0.0.1:{port}" for port in ports)

    async def scenario() -> None:
        registry = NodeRegistry((), (), poll_interval_s=0.05)
        discovery = NodeDiscovery([], [], refresh_s=0.05, resolver=FakeDns({}))
        try:
            await registry.update_nodes("decode", [a])
            assert [(n.address, n.healthy) for n in registry.decode_nodes] == [(a, True)]
            node_a = registry.decode_nodes[0]
            node_a.num_inflight = 1  # a stream open on it
            await registry.update_nodes("decode", [b])
            assert [(n.address, n.healthy) for n in registry.decode_nodes] == [(b, True)]
            await registry.poll_once()
            assert a in registry._retired  # its channel stays open for the stream
            await registry.update_nodes("decode", [a, b])  # back before it drained: same node
            assert registry.decode_nodes[1] is node_a and not registry._retired
            await registry.update_nodes("decode", [b])
            node_a.num_inflight = 0  # the stream ended
            await registry.poll_once()
            assert not registry._retired
            await discovery.refresh(registry)  # no entries: no nodes
            assert registry.decode_nodes == []
        finally:
            await discovery.close()
            await registry.close()

    try:
        bg_loop.run(scenario())
    finally:
        for node in nodes:
            assert node.server is not None
            bg_loop.run(node.server.stop(None))
