"""Per-request KV block bookkeeping on top of the BlockPool."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.kv_cache.hashing import extend_block_hashes, extra_keys
from pdserve.engine.request import Request
from pdserve.engine.utils import cdiv


class PrefixMatch(NamedTuple):
    """Cached blocks matching a request's prefix, and the tokens they hold."""

    blocks: list[KVCacheBlock]
    num_tokens: int


NO_MATCH = PrefixMatch([], 0)


class KVCacheManager:
    """Which blocks each request holds. A request's block list covers token positions
    [0, len(blocks) * block_size); block i holds positions [i * block_size, (i + 1) * block_size).
    The manager owns one reference on each block in a request's list."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0
        """Tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        self.prefix_hits = 0
        """Tokens found there (vLLM's prefix_cache_hits)."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> PrefixMatch:
        """The longest cached prefix of a request not yet holding blocks. The last token is
        never served from cache (its logits must be computed), so at most
        (num_tokens - 1) // block_size blocks match."""
        if not self.enable_caching:
            return NO_MATCH
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixMatch = NO_MATCH,
        num_lookahead_tokens: int = 0,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens (+ num_lookahead_tokens speculative ones) after the
        request's computed tokens and the cached prefix. Returns the newly allocated blocks, or
        None (changing nothing) if the pool cannot supply them. cache=False keeps the new
        blocks out of the prefix cache until cache_blocks() (their KV arrives from elsewhere)."""
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + prefix.num_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = cdiv(total, self.block_size) - len(held) - len(prefix.blocks)
        # Reusing a cached block that sits in the free queue takes it out of the queue.
        num_evictable_reused = sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_evictable_reused:
            return None
        self.pool.touch(prefix.blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        held = self.req_blocks.setdefault(request.request_id, held)
        held.extend(prefix.blocks)
        held.extend(new_blocks)
        if cache:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that are full once num_tokens are computed to the cache."""
        if self.enable_caching:
            self._cache_full_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release every block the request holds, last block first (evicted first)."""
        self.free_request_id(request.request_id)

    def free_request_id(self, request_id: str) -> None:
        """free() by id, for holders that track their own progress (a draft model)."""
        blocks = self.req_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's trailing blocks that lie wholly past positions [0, num_tokens),
        last block first: after speculative verification, the blocks that only held rejected
        drafts' slots. The blocks kept still hold those garbage slots past num_tokens; they
        are overwritten before anything attends to them. Never frees a cached block (cached
        blocks are full of computed tokens, all below num_tokens)."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        keep = cdiv(num_tokens, self.block_size)
        assert keep >= self._num_cached_blocks.get(request_id, 0)
        if keep < len(blocks):
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def allocate_positions(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block list to cover positions [0, num_tokens), with new blocks
        only (no prefix caching): for holders that track their own progress (a draft model).
        False, changing nothing, if the pool cannot supply them."""
        held = self.req_blocks.setdefault(request_id, [])
        num_needed = cdiv(num_tokens, self.block_size) - len(held)
        if num_needed > self.pool.num_free_blocks:
            if not held:
                del self.req_blocks[request_id]
            return False
        held.extend(self.pool.get_new_blocks(max(num_needed, 0)))
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once num_tokens tokens are computed."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request, num_tokens)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            # If another request cached the same content first, ours stays private: it holds
            # the same KV, and swapping it would need the model runner to know.
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        if num_tokens // self.block_size > len(request.block_hashes):
            tokens = request.token_slice(0, num_tokens)
            extend_block_hashes(
                request.block_hashes,
                tokens,
                self.block_size,
                extra_keys(request.cache_salt, request.lora_name),
            )
