from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def test_allocate_exact_blocks_and_free_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = req("a", range(10))
    assert [b.block_id for b in kv.allocate_slots(r, 10)] == [1, 2, 3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # positions 10, 11 fit in block 3
    assert [b.block_id for b in kv.allocate_slots(r, 3)] == [4]  # 13 tokens -> 4 blocks
    kv.free(r)  # tail first: 4 3 2 1 pushed, handed out again before the never-used 5 6 7
    assert kv.pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert kv.get_block_ids("a") == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = req("a", range(13))
    assert kv.allocate_slots(r, 13) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("a") == []


def test_prefix_hit_shares_blocks_and_never_serves_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(12))
    assert kv.get_computed_blocks(a).num_tokens == 0
    kv.allocate_slots(a, 12)  # 3 full blocks cached: 1 2 3
    b = req("b", range(12))
    match = kv.get_computed_blocks(b)
    # 12 tokens: the last must be computed, so only 2 blocks (8 tokens) can be served
    assert [blk.block_id for blk in match.blocks] == [1, 2] and match.num_tokens == 8
    kv.allocate_slots(b, 4, match)
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
    # a freed 3 (1, 2 still held by b); b then freed 4, 2, 1 tail first. 4 is b's private
    # copy of a's block 3 (no hash): it goes first, the cached blocks last, in free order
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_cached_free_blocks_are_reused_after_free_and_counted():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)  # blocks 1 2 3, two full cached
    kv.free(a)
    b = req("b", [1, 2, 3, 4, 9])
    match = kv.get_computed_blocks(b)
    assert match.num_tokens == 4
    # 3 free blocks, 2 of them are the reused cached ones: one new block needed, one available
    new = kv.allocate_slots(b, 1, match)
    assert [x.block_id for x in new] == [3]
    assert kv.num_free_blocks == 0
    assert kv.prefix_queries == 5 and kv.prefix_hits == 4


def test_different_salt_never_shares():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(9), salt="alice")
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(req("b", range(9), salt="bob")).num_tokens == 0
    assert kv.get_computed_blocks(req("c", range(9))).num_tokens == 0
    assert kv.get_computed_blocks(req("d", range(9), salt="alice")).num_tokens == 8


def test_lookahead_slots_are_allocated_but_not_cached():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", range(4))
    kv.allocate_slots(r, 4, num_lookahead_tokens=3)
    assert kv.get_block_ids("a") == [1, 2]
    assert kv.pool.blocks[1].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
