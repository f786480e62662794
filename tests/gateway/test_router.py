"""Router: power of two choices over decode nodes, prefix-affinity ranking of prefill nodes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from pdserve.gateway.registry import NodeRegistry, NodeState
from pdserve.gateway.router import PrefixIndex, Router, block_hashes, decode_score
from pdserve.v1 import node_pb2


class ScriptedRng(random.Random):
    """sample() returns the given pairs in turn (by address), so picks are exact."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__(0)
        self._pairs = iter(pairs)

    def sample(self, population, k):  # type: ignore[override]
        by_address = {n.address: n for n in population}
        return [by_address[a] for a in next(self._pairs)]


@pytest.fixture
def registry() -> Iterator[NodeRegistry]:
    """A registry that is never started: the tests set each node's load by hand. Its gRPC
    channels (never connected) need an event loop to be made on and closed."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    reg = NodeRegistry(("d0:1", "d1:1", "d2:1"), ("p0:1", "p1:1"))
    yield reg
    loop.run_until_complete(reg.close())
    asyncio.set_event_loop(None)
    loop.close()


def set_load(
    node: NodeState,
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    accepting: bool = True,
    block_size: int = 4,
) -> None:
    node.load = node_pb2.NodeLoad(
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=free,
        block_size=block_size,
        accepting=accepting,
    )
    node.healthy = True


def test_block_hashes_are_chained_and_salted() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial block [9] is not hashed
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert a[0] == b[0] and a[1] != b[1]
    c = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert c[1] != a[1]  # same second block, different parent
    assert block_hashes([1, 2, 3, 4], 4, "salt") != block_hashes([1, 2, 3, 4], 4)


def test_prefix_index_matches_leading_hashes_and_evicts_lru() -> None:
    index = PrefixIndex(max_hashes=3)
    index.add([b"a", b"b"])
    assert index.match([b"a", b"b", b"c"]) == 2
    assert index.match([b"x", b"b"]) == 0  # only a leading run counts
    index.add([b"c"])
    index.add([b"a"])  # touch a: b is now the oldest
    index.add([b"d"])
    assert len(index) == 3
    assert index.match([b"a"]) == 1 and index.match([b"b"]) == 0


def test_decode_score_orders_by_requests_then_free_blocks(registry: NodeRegistry) -> None:
    d0, d1, d2 = registry.decode_nodes
    set_load(d0, running=2, waiting=1, free=10)
    set_load(d1, running=3, free=50)
    set_load(d2, running=1, free=5)
    assert decode_score(d0) == (3, -10)
    assert decode_score(d1) == (3, -50)
    d2.num_inflight = 7  # the gateway's own open calls are fresher than the poll
    assert decode_score(d2) == (7, -5)


def test_pick_decode_power_of_two(registry: NodeRegistry) -> None:
    d0, d1, d2 = registry.decode_nodes
    set_load(d0, running=5)
    set_load(d1, running=1)
    set_load(d2, running=1, free=200)
    rng = ScriptedRng([("d0:1", "d1:1"), ("d1:1", "d2:1"), ("d2:1", "d0:1"), ("d1:1", "d0:1")])
    router = Router(registry, rng)
    assert router.pick_decode().address == "d1:1"
    assert router.pick_decode().address == "d2:1"  # same requests, more free blocks
    assert router.pick_decode().address == "d2:1"
    assert router.pick_decode(exclude={"d2:1"}).address == "d1:1"


def test_pick_decode_skips_unhealthy_and_draining(registry: NodeRegistry) -> None:
    d0, d1, d2 = registry.decode_nodes
    set_load(d0)
    set_load(d1, accepting=False)
    set_load(d2)
    d2.healthy = False
    router = Router(registry, random.Random(0))
    assert {router.pick_decode().address for _ in range(20)} == {"d0:1"}
    assert router.pick_decode(exclude={"d0:1"}) is None


def test_pick_decode_never_picks_the_busiest_of_three(registry: NodeRegistry) -> None:
    for node, running in zip(registry.decode_nodes, (0, 3, 9), strict=True):
        set_load(node, running=running)
    router = Router(registry, random.Random(1))
    picks = [router.pick_decode().address for _ in range(300)]
    assert "d2:1" not in picks
    assert picks.count("d0:1") > picks.count("d1:1") > 0


def test_rank_prefill_by_routed_prefix_then_load(registry: NodeRegistry) -> None:
    p0, p1 = registry.prefill_nodes
    set_load(p0, running=4)
    set_load(p1, running=1)
    router = Router(registry)
    prompt = list(range(10))  # block size 4: two full blocks
    ranked = router.rank_prefill(prompt)
    assert [(c.node.address, c.matched_blocks) for c in ranked] == [("p1:1", 0), ("p0:1", 0)]
    router.record_prefill("p0:1", prompt)
    router.record_prefill("elsewhere:1", prompt)  # unknown: ignored
    ranked = router.rank_prefill(list(range(8)) + [99, 98, 97, 96])
    assert [(c.node.address, c.matched_blocks) for c in ranked] == [("p0:1", 2), ("p1:1", 0)]
    ranked = router.rank_prefill(list(range(4)) + [50] * 8)
    assert [(c.node.address, c.matched_blocks) for c in ranked] == [("p0:1", 1), ("p1:1", 0)]
    # another salt shares nothing
    ranked = router.rank_prefill(prompt, cache_salt="tenant-b")
    assert [(c.node.address, c.matched_blocks) for c in ranked] == [("p1:1", 0), ("p0:1", 0)]
    p1.healthy = False
    assert [c.node.address for c in router.rank_prefill(prompt)] == ["p0:1"]
