from pdserve.engine.kv_cache.hashing import extend_block_hashes, extra_keys, hash_block


def test_chained_hash_depends_on_parent_tokens_and_extra():
    h1 = hash_block(None, [1, 2])
    assert len(h1) == 32  # 256-bit: collisions are not a practical concern
    assert hash_block(None, [1, 2]) == h1
    assert hash_block(None, [2, 1]) != h1
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2], extra_keys("a")) != hash_block(None, [1, 2], extra_keys("b"))
    assert extra_keys(None) == b"" and extra_keys("") == b""


def test_extend_hashes_full_blocks_only_and_incrementally():
    hashes = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], block_size=2)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, [1, 2])
    assert hashes[1] == hash_block(hashes[0], [3, 4])
    before = list(hashes)
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], block_size=2)
    assert hashes[:2] == before and hashes[2] == hash_block(hashes[1], [5, 6])


def test_same_tokens_in_other_position_hash_differently():
    a, b = [], []
    extend_block_hashes(a, [7, 7, 7, 7], block_size=2)
    extend_block_hashes(b, [7, 7], block_size=2)
    assert a[0] == b[0] and a[1] != a[0]
