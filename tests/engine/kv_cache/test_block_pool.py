import pytest

from pdserve.engine.kv_cache.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, only 0 free"):
        pool.get_new_blocks(1)


def test_freed_empty_blocks_are_handed_out_again_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1 2 3
    assert pool.free_block_ids() == [4, 5]
    pool.free_blocks(reversed(a))  # tail first: 3 2 1 pushed, 1 on top
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 0 for b in a)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]  # the used ones before the never-used 4 5


def test_high_water_is_the_highest_block_ever_handed_out():
    pool = BlockPool(8)
    assert pool.high_water == 0
    a = pool.get_new_blocks(3)  # 1 2 3
    assert pool.high_water == 3
    pool.free_blocks(reversed(a))
    pool.get_new_blocks(2)  # the freed 1 2: nothing new touched
    assert pool.high_water == 3
    pool.get_new_blocks(3)  # 3, then the never-used 4 5
    assert pool.high_water == 5


def test_cached_blocks_are_evicted_only_when_no_empty_block_is_left():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)  # 1 2
    pool.cache_block(a, b"a")
    pool.free_blocks([b, a])  # b (no hash) on the empty stack, a to the cached queue
    assert pool.free_block_ids() == [2, 3, 4, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4] and pool.get_cached_block(b"a") is a
    (taken,) = pool.get_new_blocks(1)
    assert taken is a and a.block_hash is None and pool.get_cached_block(b"a") is None


def test_reset_prefix_cache_puts_the_used_blocks_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 1 2
    for i, block in enumerate(a):
        pool.cache_block(block, bytes([i]))
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    assert pool.reset_prefix_cache()
    assert pool.free_block_ids() == [1, 2, 3, 4, 5] and pool.get_cached_block(b"\x00") is None
    assert all(b.block_hash is None for b in a)


def test_ref_counts_and_touch():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h")
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.free_block_ids() == [2, 3, 1]
    # cached and free: reusable by hash; touching takes it out of the free queue
    assert pool.get_cached_block(b"h") is b
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.free_block_ids() == [2, 3]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b, b])


def test_eviction_clears_hash_lru_first():
    pool = BlockPool(3)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, b"one")
    pool.cache_block(b2, b"two")
    pool.free_blocks([b2, b1])  # b2 evicted first
    (taken,) = pool.get_new_blocks(1)
    assert taken is b2 and taken.block_hash is None
    assert pool.get_cached_block(b"two") is None
    assert pool.get_cached_block(b"one") is b1


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, b"x") is b1
    assert pool.cache_block(b2, b"x") is b1
    assert b2.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"x")
    assert pool.get_cached_block(b"x") is None


def test_usage_and_reset():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.cache_block(blocks[0], b"a")
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.usage == 0.0
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"a") is None
