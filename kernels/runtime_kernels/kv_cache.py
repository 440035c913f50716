"""Writing new keys/values into the paged KV cache by slot, and its torch reference.

A slot is ``block_id * block_size + offset``; the caches are
``[num_blocks, block_size, num_kv_heads, head_size]`` (``kv_cache[0]`` and
``kv_cache[1]`` of the ``[2, ...]`` layer tensor). Negative slots are skipped, so a
padded batch (CUDA graphs) can mark its padding tokens with ``-1``.

A value cache may also be *slot-minor* (:func:`slot_minor`): the same block bytes ordered
``[num_kv_heads, head_size, block_size]``, seen through strides as the usual shape. The
write and the attention kernels read its strides; an 8-bit cache's attention then loads
each dimension's slots of a block as one run of bytes.
"""

from __future__ import annotations

import torch

from runtime_kernels.utils import check_last_dim_contiguous, interpreting, next_power_of_2, require_triton


def slot_minor(cache: torch.Tensor) -> torch.Tensor:
    """A view of the ``[num_blocks, block_size, num_kv_heads, head_size]`` cache whose blocks, each in its own
    bytes, hold their slots last: ``[num_kv_heads, head_size, block_size]`` (same shape and indexing)."""
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    if cache.stride(1) != num_kv_heads * head_size or cache.stride(2) != head_size or cache.stride(3) != 1:
        raise ValueError(f"slot_minor takes a cache whose blocks are contiguous, got strides {cache.stride()}")
    return cache.as_strided(cache.shape, (cache.stride(0), 1, head_size * block_size, block_size),
                            cache.storage_offset())


def is_slot_minor(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is a :func:`slot_minor` view (with more than one slot a block)."""
    _, block_size, _, head_size = cache.shape
    return block_size > 1 and cache.stride(1) == 1 and cache.stride(3) == block_size and \
        cache.stride(2) == head_size * block_size


def check_value_cache(name: str, cache: torch.Tensor) -> None:
    """The kernels take a value cache whose last dimension is contiguous, or a :func:`slot_minor` view."""
    if not is_slot_minor(cache):
        check_last_dim_contiguous(name, cache)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written
    value_cache: torch.Tensor,  # same shape, written
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store token ``t``'s keys and values at cache slot ``slot_mapping[t]``."""
    require_triton("reshape_and_cache")
    if interpreting() and key_cache.element_size() == 1:
        # Triton's interpreter rounds to 8-bit floats without carrying into the exponent
        # (1.97 -> 1.0 instead of 2.0); convert with torch there. Compiled kernels convert.
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    _write(key, value, key_cache, value_cache, slot_mapping)


def rotary_reshape_and_cache(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], left as it is
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written
    value_cache: torch.Tensor,  # same shape, written
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_size] float32: cos | sin
) -> None:
    """``rotary_embedding(positions, query, key, cos_sin_cache)`` then ``reshape_and_cache(key, value, ...)`` in one
    launch, with the same results in ``query`` and the caches; the rotated keys go to the cache only."""
    require_triton("rotary_reshape_and_cache")
    from runtime_kernels.rotary import rotary_embedding

    head_size = key.shape[-1]
    if interpreting() and key_cache.element_size() == 1:  # see reshape_and_cache: torch converts there
        rotated = key.clone()
        rotary_embedding(positions, query, rotated, cos_sin_cache)
        reshape_and_cache(rotated, value, key_cache, value_cache, slot_mapping)
        return
    if head_size % 2 or cos_sin_cache.shape[-1] != head_size or query.shape[-1] != head_size:
        raise ValueError(f"head_size {head_size} must be even and match the query's {query.shape[-1]} and the "
                         f"cos/sin cache's last dimension {cos_sin_cache.shape[-1]}")
    for name, t in (("query", query), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    _write(key, value, key_cache, value_cache, slot_mapping, (positions, query, cos_sin_cache))


def _write(key, value, key_cache, value_cache, slot_mapping, rotation=None) -> None:
    """The one launch of both: ``rotation`` is (positions, query, cos_sin_cache), or None for a plain write."""
    from runtime_kernels.jit.kv_cache import reshape_and_cache_kernel

    num_tokens, num_kv_heads, head_size = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_size):
        raise ValueError(f"key shape {tuple(key.shape)} does not fit cache shape {tuple(key_cache.shape)}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache)):
        check_last_dim_contiguous(name, t)
    check_value_cache("value_cache", value_cache)
    if num_tokens == 0:
        return
    positions, query, cos_sin_cache = rotation if rotation is not None else (slot_mapping, key, key)  # unread stand-ins
    reshape_and_cache_kernel[(num_tokens,)](
        positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, query.shape[1], num_kv_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), cos_sin_cache.stride(0),
        ROTATE=rotation is not None,
        HEAD_SIZE=head_size,
        HALF=head_size // 2,
        HALF_PAD=next_power_of_2(max(head_size // 2, 1)),
        HEAD_PAD=next_power_of_2(head_size),
        Q_HEADS_PAD=next_power_of_2(query.shape[1]),
        HEADS_PAD=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1],
        V_SLOT_MINOR=is_slot_minor(value_cache),
    )


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The same write by indexing each slot's block and offset (skipping negative slots); any strides."""
    keep = slot_mapping >= 0
    blocks, offsets = slot_mapping[keep] // key_cache.shape[1], slot_mapping[keep] % key_cache.shape[1]
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)
