"""Router: which decode node runs a request, and which prefill nodes to offer it, best first.

Decode: power of two choices over the healthy accepting decode nodes, scored on (queued +
running requests, free KV blocks). Prefill: join the shortest queue, in prompt tokens still to
compute: the tokens this gateway has routed to each node and not seen finish, plus this prompt's
tokens that the node has not already prefilled (leading blocks the gateway routed there before:
their KV is probably still in its prefix cache).

Both read what the gateway itself has sent, counted as it sends it: within a burst the polled
loads are all from before the burst, and a choice on them alone sends the whole burst to the one
node that looked idlest.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from pdserve.gateway.registry import NodeRegistry, NodeState

DEFAULT_MAX_HASHES_PER_NODE = 1 << 16


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """Chained hashes of the full blocks of token_ids: hash i covers tokens [0, (i + 1) *
    block_size), so equal hashes mean equal prefixes. The salt keys the first block."""
    hashes: list[bytes] = []
    parent = hashlib.sha256(cache_salt.encode()).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        data = parent + b"".join(t.to_bytes(4, "little", signed=True) for t in block)
        parent = hashlib.sha256(data).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The block hashes of prompts routed to one prefill node; the least recently used are
    forgotten beyond max_hashes (the node's cache evicts too, so old entries are guesses)."""

    def __init__(self, max_hashes: int = DEFAULT_MAX_HASHES_PER_NODE) -> None:
        self._max_hashes = max_hashes
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[bytes]) -> int:
        """Number of leading hashes present (the routed prefix length, in blocks)."""
        matched = 0
        for h in hashes:
            if h not in self._hashes:
                break
            matched += 1
        return matched

    def add(self, hashes: Sequence[bytes]) -> None:
        """Remember hashes as most recently used, evicting the oldest beyond the bound."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._max_hashes:
            self._hashes.popitem(last=False)


class PrefillCandidate(NamedTuple):
    """A ranked prefill node and how many leading prompt blocks were routed to it before."""

    node: NodeState
    matched_blocks: int


def _serves(node: NodeState, model_version: str | None) -> bool:
    """Whether node serves model_version (any, when None)."""
    return model_version is None or (
        node.load is not None and node.load.model_version == model_version
    )


def decode_score(node: NodeState) -> tuple[int, int]:
    """Lower is better: requests on the node, then more free blocks. The polled count can be
    up to a poll interval old: the gateway's own open calls replace their share of it (others'
    requests, e.g. another gateway's, keep their polled count)."""
    load = node.load
    queued = load.num_running + load.num_waiting if load is not None else 0
    free_blocks = load.num_free_blocks if load is not None else 0
    others = max(queued - node.inflight_at_poll, 0)
    return node.num_inflight + others, -free_blocks


def _prefill_cost(node: NodeState, prompt_len: int, matched_blocks: int) -> tuple[int, int, int]:
    """Lower is better: prompt tokens the node would still compute before this one's are done,
    then its polled queue, then fewer free blocks."""
    load = node.load
    if load is None:
        return prompt_len + node.pending_prefill_tokens, 0, 0
    uncached = max(prompt_len - matched_blocks * load.block_size, 0)
    queued = load.num_running + load.num_waiting
    return node.pending_prefill_tokens + uncached, queued, -load.num_free_blocks


class Router:
    """Routing decisions over a NodeRegistry's current view (no I/O)."""

    def __init__(
        self,
        registry: NodeRegistry,
        rng: random.Random | None = None,
        max_hashes_per_node: int = DEFAULT_MAX_HASHES_PER_NODE,
    ) -> None:
        self._registry = registry
        self._rng = rng or random.Random()
        self._max_hashes_per_node = max_hashes_per_node
        self._prefix_indexes: dict[str, PrefixIndex] = {}

    def pick_decode(
        self, exclude: Collection[str] = (), model_version: str | None = None
    ) -> NodeState | None:
        """The better of two random accepting decode nodes, of model_version when given (None
        when none accepts)."""
        nodes = [
            n
            for n in self._registry.decode_nodes
            if n.accepting and n.address not in exclude and _serves(n, model_version)
        ]
        if len(nodes) <= 1:
            return nodes[0] if nodes else None
        first, second = self._rng.sample(nodes, 2)
        return second if decode_score(second) < decode_score(first) else first

    def rank_prefill(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
        model_version: str | None = None,
    ) -> list[PrefillCandidate]:
        """Accepting prefill nodes (of model_version when given: KV only moves between nodes
        of one version), cheapest first: fewest prompt tokens queued there (_prefill_cost),
        counting the cached prefix as free."""
        ranked = []
        for node in self._registry.prefill_nodes:
            if not node.accepting or not _serves(node, model_version):
                continue
            hashes = self._hashes(node, prompt_token_ids, cache_salt)
            ranked.append(PrefillCandidate(node, self._index(node).match(hashes)))
        n = len(prompt_token_ids)
        ranked.sort(key=lambda c: _prefill_cost(c.node, n, c.matched_blocks))
        return ranked

    @staticmethod
    def reserve_prefill(candidate: PrefillCandidate, num_prompt_tokens: int) -> Callable[[], None]:
        """Count the prompt's uncached tokens into the candidate's queue until the returned
        release() is called (once the prefill is over, or the call failed; idempotent)."""
        node = candidate.node
        block_size = node.load.block_size if node.load is not None else 0
        tokens = max(num_prompt_tokens - candidate.matched_blocks * block_size, 0)
        node.pending_prefill_tokens += tokens
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                node.pending_prefill_tokens -= tokens

        return release

    def record_prefill(
        self, address: str, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> None:
        """The prompt was prefilled on the prefill node at address (unknown addresses are
        ignored): later prompts sharing its prefix should follow it there."""
        for node in self._registry.prefill_nodes:
            if node.address == address:
                self._index(node).add(self._hashes(node, prompt_token_ids, cache_salt))

    def _index(self, node: NodeState) -> PrefixIndex:
        index = self._prefix_indexes.get(node.address)
        if index is None:
            index = self._prefix_indexes[node.address] = PrefixIndex(self._max_hashes_per_node)
        return index

    @staticmethod
    def _hashes(node: NodeState, prompt_token_ids: Sequence[int], cache_salt: str) -> list[bytes]:
        block_size = node.load.block_size if node.load is not None else 0
        if block_size <= 0:
            return []
        return block_hashes(prompt_token_ids, block_size, cache_salt)
