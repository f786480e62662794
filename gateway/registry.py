"""NodeRegistry: the decode and prefill nodes, their latest load and whether they are healthy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc

from pdserve.common.tls import TLSFiles, aio_channel
from pdserve.v1 import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)

Role = Literal["decode", "prefill"]

# Reconnect quickly to a node that comes back: gRPC's default backoff grows to two minutes.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(eq=False)
class NodeState:
    """One node as the gateway sees it. Mutated only on the event loop."""

    address: str
    role: Role
    channel: grpc.aio.Channel
    load: node_pb2.NodeLoad | None = None
    """The latest successful GetLoad answer (kept while unhealthy: last known capacity)."""
    healthy: bool = False
    """True after a successful poll of an accepting node, until a failed poll or call."""
    num_inflight: int = 0
    """Generate calls this gateway has open on the node (fresher than the polled load)."""
    inflight_at_poll: int = 0
    """num_inflight when the latest load was polled (the part of its queue that is ours)."""
    pending_prefill_tokens: int = 0
    """Prompt tokens this gateway has routed to the node (a prefill node: as first candidate)
    whose prefill has not finished yet: the node's queue as of now, not as of the last poll."""
    last_error: str = ""
    decode_stub: node_pb2_grpc.DecodeNodeStub = field(init=False)
    prefill_stub: node_pb2_grpc.PrefillNodeStub = field(init=False)

    def __post_init__(self) -> None:
        self.decode_stub = node_pb2_grpc.DecodeNodeStub(self.channel)
        self.prefill_stub = node_pb2_grpc.PrefillNodeStub(self.channel)

    @property
    def accepting(self) -> bool:
        """Healthy and willing to take new requests."""
        return self.healthy and self.load is not None and self.load.accepting


class NodeRegistry:
    """Polls GetLoad on every node every poll_interval_s (each poll with a deadline) and keeps
    the answers. A node is healthy after a successful poll that says it is accepting, and
    unhealthy after a failed poll, a refusal, or a failed call reported by the request path."""

    def __init__(
        self,
        decode_addresses: tuple[str, ...],
        prefill_addresses: tuple[str, ...],
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 1.0,
        tls: TLSFiles | None = None,
    ) -> None:
        self._tls = tls
        self._poll_interval_s = poll_interval_s
        self._poll_timeout_s = poll_timeout_s
        self.decode_nodes = [self._node(a, "decode") for a in decode_addresses]
        self.prefill_nodes = [self._node(a, "prefill") for a in prefill_addresses]
        self._retired: dict[str, NodeState] = {}
        """Nodes discovery removed whose streams are still open: unrouted, unpolled; their
        channel closes when the last stream ends."""
        self._task: asyncio.Task[None] | None = None

    def _node(self, address: str, role: Role) -> NodeState:
        channel = aio_channel(address, self._tls, _CHANNEL_OPTIONS)
        return NodeState(address, role, channel)

    @property
    def nodes(self) -> list[NodeState]:
        return self.decode_nodes + self.prefill_nodes

    async def start(self) -> None:
        """Poll once (so routing can start at once), then keep polling in the background."""
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="node-registry-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        nodes = self.nodes + list(self._retired.values())
        await asyncio.gather(*(node.channel.close() for node in nodes))

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(node) for node in self.nodes))
        await self._close_idle_retired()

    async def update_nodes(self, role: Role, addresses: Sequence[str]) -> None:
        """Make role's nodes exactly addresses (gateway/discovery.py calls this). New ones are
        polled first, so that a set replaced at once by another leaves no moment without a
        healthy node; removed ones get no new requests while the streams open on them finish."""
        current = self.decode_nodes if role == "decode" else self.prefill_nodes
        known = {node.address for node in current}
        added = [self._revived(a, role) for a in dict.fromkeys(addresses) if a not in known]
        await asyncio.gather(*(self._poll(node) for node in added))
        wanted = set(addresses)
        for node in current:
            if node.address not in wanted:
                streams = node.num_inflight
                logger.info("%s node %s removed (%d streams open)", role, node.address, streams)
                self._retired[node.address] = node
        for node in added:
            logger.info("%s node %s added", role, node.address)
        # In place: the router reads these very lists.
        current[:] = [node for node in current if node.address in wanted] + added
        await self._close_idle_retired()

    def _revived(self, address: str, role: Role) -> NodeState:
        """A node for an address that appears: the retired one, back before it drained, or new."""
        retired = self._retired.get(address)
        if retired is not None and retired.role == role:
            return self._retired.pop(address)
        return self._node(address, role)

    async def _close_idle_retired(self) -> None:
        idle = [node for node in self._retired.values() if node.num_inflight == 0]
        for node in idle:
            del self._retired[node.address]
        await asyncio.gather(*(node.channel.close() for node in idle))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll(self, node: NodeState) -> None:
        stub = node.decode_stub if node.role == "decode" else node.prefill_stub
        try:
            load = await stub.GetLoad(node_pb2.GetLoadRequest(), timeout=self._poll_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.mark_failed(node, f"GetLoad failed: {exc.code().name} {exc.details()}")
            return
        role_changed = node.load is None or node.load.role != load.role
        if role_changed and load.role not in (node.role, "aggregated"):
            logger.warning("%s node %s reports role %r", node.role, node.address, load.role)
        node.load = load
        node.inflight_at_poll = node.num_inflight
        if not load.accepting:
            self._set_health(node, False, "not accepting (draining)")
            return
        self._set_health(node, True, "")

    def mark_failed(self, node: NodeState, reason: str) -> None:
        """A poll or a call failed: route nothing to the node until a poll succeeds again."""
        self._set_health(node, False, reason)

    @staticmethod
    def _set_health(node: NodeState, healthy: bool, reason: str) -> None:
        if healthy and not node.healthy:
            logger.info("%s node %s is healthy", node.role, node.address)
        elif not healthy and (node.healthy or reason != node.last_error):
            # a node that never answered yet is starting (or absent): not news worth a warning
            log = logger.warning if node.load is not None else logger.info
            log("%s node %s is unhealthy: %s", node.role, node.address, reason)
        node.healthy = healthy
        node.last_error = reason

    def max_model_len(self) -> int | None:
        """The smallest max_model_len any decode node has reported (None: none has)."""
        lengths = [
            n.load.max_model_len
            for n in self.decode_nodes
            if n.load is not None and n.load.max_model_len > 0
        ]
        return min(lengths) if lengths else None

    def is_ready(self) -> bool:
        """At least one decode node accepts: requests can be served (decode nodes prefill
        locally when no prefill node can)."""
        return any(n.accepting for n in self.decode_nodes)

    def tier_status(self) -> dict[str, object]:
        """What /health says beyond its status code: "ok", or "degraded" while some tier
        has nodes configured that are not accepting (no prefill node: decode nodes prefill
        locally); accepting/total per tier. Counts only: no node addresses."""
        tiers = {"decode": self.decode_nodes, "prefill": self.prefill_nodes}
        counts = {
            role: {"accepting": sum(n.accepting for n in nodes), "total": len(nodes)}
            for role, nodes in tiers.items()
        }
        degraded = any(c["accepting"] < c["total"] for c in counts.values())
        return {"status": "degraded" if degraded else "ok", "nodes": counts}
