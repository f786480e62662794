"""Chained hashes of full KV blocks for automatic prefix caching.

hash(block i) = sha256(hash(block i - 1) || token ids of block i || extra keys). SHA-256 makes a
collision (two different prefixes mapping to one block) practically impossible, so a cache hit is
never turned into wrong output. Extra keys (cache_salt, the LoRA adapter's name) go into every block's
hash, so requests with different salts never share a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"pdserve-prefix-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extra_keys(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """Bytes mixed into every block hash of a request: its salt and its LoRA adapter's name
    (blocks computed under one adapter are never another's or the base model's); empty when
    it has neither."""
    out = b""
    if cache_salt:
        out += b"\x00salt:" + cache_salt.encode()
    if lora_name:
        out += b"\x00lora:" + lora_name.encode()
    return out


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> None:
    """Append the hashes of the full blocks of token_ids not hashed yet (incremental)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
