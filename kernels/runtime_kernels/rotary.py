"""Rotary position embedding (NeoX "rotate half" layout) from a cos/sin cache.

The cache is ``[max_position, head_size]`` float32: ``cos`` of each position's angles in
the first half, ``sin`` in the second. Scaled RoPE variants (linear, Llama 3) only
change the inverse frequencies, so :func:`build_cos_sin_cache` takes them from
``runtime.models.rotary.inverse_frequencies`` and the kernel stays the same.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime_kernels.utils import check_last_dim_contiguous, next_power_of_2, require_triton


def build_cos_sin_cache(
    rope_params: dict[str, Any], head_size: int, max_position: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[max_position, head_size]`` float32 cos | sin for the RoPE settings ``rope_params``."""
    from runtime.models.rotary import inverse_frequencies

    inv_freq = inverse_frequencies(rope_params, head_size, max_position)  # [head_size // 2]
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` in place by their tokens' positions; returns them."""
    require_triton("rotary_embedding")
    from runtime_kernels.jit.rotary import rotary_kernel

    num_tokens, num_heads, head_size = query.shape
    if head_size % 2 or cos_sin_cache.shape[-1] != head_size:
        raise ValueError(
            f"head_size {head_size} must be even and match the cache's last dimension {cos_sin_cache.shape[-1]}"
        )
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return query, key
    half = head_size // 2
    rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_heads, key.shape[1],
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        Q_HEADS_PAD=next_power_of_2(num_heads),
        K_HEADS_PAD=next_power_of_2(key.shape[1]),
    )
    return query, key


def rotary_embedding_ref(positions, query, key, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated tensors, computed in float32 and rounded once."""
    half = query.shape[-1] // 2
    cos = cos_sin_cache[positions.long(), :half].float()[:, None, :]  # [T, 1, half]
    sin = cos_sin_cache[positions.long(), half:].float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
