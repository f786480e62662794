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
    assert decode_score(d2) == (8, -5)  # ours now + the polled one, not ours (none at the poll)
    d2.inflight_at_poll = 1  # the polled request was ours, and is among the 7
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


def test_a_burst_of_prefills_spreads_over_the_prefill_nodes(registry: NodeRegistry) -> None:
    """200 prompts routed before any poll sees them (every polled load says idle): each one
    joins the shortest queue in uncached prompt tokens, so the split is even, and releasing
    them empties the queues."""
    p0, p1 = registry.prefill_nodes
    set_load(p0, free=10)
    set_load(p1, free=500)  # looked idler at the last poll: the old ranking sent all here
    router = Router(registry)
    rng = random.Random(3)
    releases, tokens = [], {"p0:1": 0, "p1:1": 0}
    for _ in range(200):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(20, 200))]
        first = router.rank_prefill(prompt)[0]
        releases.append(router.reserve_prefill(first, len(prompt)))
        tokens[first.node.address] += len(prompt)
    assert abs(tokens["p0:1"] - tokens["p1:1"]) < 200, tokens  # within one prompt
    assert p0.pending_prefill_tokens == tokens["p0:1"]
    for release in releases:
        release()
        release()  # idempotent
    assert p0.pending_prefill_tokens == p1.pending_prefill_tokens == 0


def test_a_cached_prefix_counts_as_free_work_not_as_a_trump(registry: NodeRegistry) -> None:
    p0, p1 = registry.prefill_nodes
    set_load(p0)
    set_load(p1)
    router = Router(registry)
    system = list(range(8))  # two blocks every prompt shares
    router.record_prefill("p0:1", system)
    prompts = [system + [100 + i] * 40 for i in range(20)]
    picks = []
    for prompt in prompts:
        first = router.rank_prefill(prompt)[0]
        router.reserve_prefill(first, len(prompt))
        picks.append(first.node.address)
    assert picks[0] == "p0:1"  # the cache hit wins when queues are equal
    assert 8 <= picks.count("p0:1") <= 12  # but not the whole burst


def test_a_burst_of_streams_spreads_over_two_decode_nodes(registry: NodeRegistry) -> None:
    """12 simultaneous streams, each counted as the gateway opens it: with polled loads from
    before the burst (d1 had 3 requests then, now finished and counted as ours), the split is
    even."""
    d0, d1, d2 = registry.decode_nodes
    set_load(d0)
    set_load(d1, running=3)
    d1.inflight_at_poll = 3  # those 3 were this gateway's, since finished
    d1.num_inflight = 0
    d2.healthy = False
    router = Router(registry, random.Random(0))
    for _ in range(12):
        router.pick_decode().num_inflight += 1
    assert d0.num_inflight == d1.num_inflight == 6


def test_embeddings_go_to_prefill_nodes_least_loaded_first_else_decode(
    registry: NodeRegistry,
) -> None:
    from types import SimpleNamespace

    from pdserve.gateway.embeddings import _candidates

    for node in registry.nodes:
        set_load(node)
    p0, p1 = registry.prefill_nodes
    p0.pending_prefill_tokens = 500
    ctx = SimpleNamespace(registry=registry)
    assert [n.address for n in _candidates(ctx)] == ["p1:1", "p0:1"]  # type: ignore[arg-type]
    p0.healthy = p1.healthy = False  # no prefill tier: an aggregated deployment's decode nodes
    registry.decode_nodes[0].num_inflight = 3
    assert [n.address for n in _candidates(ctx)] == ["d1:1", "d2:1", "d0:1"]  # type: ignore[arg-type]
