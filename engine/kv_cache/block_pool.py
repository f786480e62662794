"""The pool of KV blocks: free blocks in allocation order, reference counts, hash -> block map.

Invariants:
- Block 0 is the null block: never handed out, never freed, pads block tables.
- A block is free iff its ref_cnt is 0. A free block with a hash sits in the cached queue
  (front evicted first); a free block without one sits in the empty stack.
- A block with a hash is in the hash map; it keeps its hash (and can be reused by a later
  request) while it is free, until it is handed out again (evicted).
- Allocation takes empty blocks first, the most recently freed first (then never-used ones,
  lowest id first), and evicts cached blocks only when no empty block is left. So cached
  prefixes live as long as the pool allows, and the memory a new block brings is the memory
  used last: warm in the caches, and already faulted in (the cache tensor's pages are mapped
  lazily; a never-touched page costs a page fault, which in a VM is a host fault too).
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
        # Free blocks without a hash; popped from the end (so block 1 comes first at start).
        self._empty: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in reversed(self.blocks[1:])
        )
        # Free blocks with a hash, in eviction order (front = least recently freed).
        self._cached_free: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.high_water = 0
        """The highest block id handed out so far: never-used blocks go out lowest id first,
        so the cache's pages past it have not been touched by a step (the prefault reads it
        from another thread: engine/model_runner.py)."""

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """Free ids in the order get_new_blocks hands them out (for tests and debugging)."""
        return list(reversed(self._empty)) + list(self._cached_free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # -- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n free blocks (ref_cnt 1 each): empty ones first, most recently freed first,
        then cached ones least recently freed first, evicting their hashes. Raises ValueError
        if fewer than n are free; check first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._empty:
                _, block = self._empty.popitem(last=True)
            else:
                _, block = self._cached_free.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            if block.block_id > self.high_water:
                self.high_water = block.block_id
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks being reused (removing them from the free set)."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._cached_free.pop(block.block_id, None) is None:
                    del self._empty[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order. A block reaching 0 goes to
        the back of the cached queue if it holds a hash (so pass a request's blocks
        tail-first: its last blocks, least likely to be shared, are then evicted first), else
        on top of the empty stack (handed out next)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._empty[block.block_id] = block
                else:
                    self._cached_free[block.block_id] = block

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
        """Forget every cached hash; only possible when no block is in use. The blocks that
        held cached content go on top of the empty stack (least recently freed deepest)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self._cached_free.values():
            block.block_hash = None
            self._empty[block.block_id] = block
        self._cached_free.clear()
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
