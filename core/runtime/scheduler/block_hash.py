"""Prefix-cache block hashes: sha256, chained, the same in every process and after restarts.

A block's hash covers its parent's hash, its token ids and its extra keys, so equal hashes
mean equal prefixes (up to sha256 collisions, which nobody can craft). Python's ``hash()``
would be randomised per process and cheap to collide on purpose; a digest can be shared
with other processes (KV offload tiers, disaggregated prefill) and cannot be used by one
tenant to poison another's cache.

Encoding (little-endian, fixed, no pickle): parent digest (32 bytes) | number of tokens
(uint32) | token ids (int32 each) | for each extra key: its UTF-8 length (uint32) | bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # a sha256 digest

# The parent of a request's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"runtime prefix cache, block hash v1").digest()


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """Hash of a full block, chained on its parent (None for a request's first block).

    ``extra_keys`` are whatever besides the tokens decides the block's KV values or who
    may share it (a tenant's cache salt; later LoRA names or multimodal input hashes).
    """
    data = (ROOT_HASH if parent_hash is None else parent_hash) + struct.pack(
        f"<I{len(token_ids)}i", len(token_ids), *token_ids
    )
    for key in extra_keys:
        encoded = key.encode()
        data += struct.pack("<I", len(encoded)) + encoded
    return hashlib.sha256(data).digest()


def first_block_extra_keys(cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys of a request's first block: its cache salt, if any.

    Only the first block carries the salt; every later hash chains on it, so requests
    with different salts share no block, and requests with the same salt share all.
    """
    return () if cache_salt is None else ("cache_salt:" + cache_salt,)
