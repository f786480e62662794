"""The pool of KV blocks: free queue in eviction order, reference counts, hash -> block map.

Invariants:
- Block 0 is the null block: never handed out, never freed, pads block tables.
- A block is in the free queue iff its ref_cnt is 0. The queue's front is evicted first.
- A block with a hash is in the hash map; it keeps its hash (and can be reused by a later
  request) while it sits in the free queue, until it is handed out again (evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.kv_cache.hashing import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One KV page of block_size token slots in every layer."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Set once the block is full and cached; cleared on eviction."""

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Owns every KVCacheBlock. Hands out free blocks (evicting cached ones LRU-first), keeps
    reference counts, and maps block hashes to cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently held
        # block_id -> block, in eviction order (front = least recently freed).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """Ids in eviction order (for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # -- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue (ref_cnt 1 each), evicting their
        cached hashes. Raises ValueError if fewer than n are free; check first."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks being reused (removing them from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; a block reaching 0 goes to the
        back of the free queue (so pass a request's blocks tail-first: its last blocks, least
        likely to be shared, are then evicted first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> KVCacheBlock:
        """Register a full block under its hash. If another block already holds this hash (two
        requests computed the same prefix at once), the existing one stays the cached copy and
        this one stays private. Returns the block now registered for the hash."""
        if not self.enable_caching or block.block_hash is not None:
            return block
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
