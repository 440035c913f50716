"""Paged attention in a few lines of plain torch: one request at a time.

Slow but simple, and a starting point for a real kernel. The KV cache of a layer is
``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, then values); token
``t`` of a request lives in slot ``block_table[t // block_size] * block_size +
t % block_size``.
"""

from __future__ import annotations

import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata


class TorchPagedAttention:
    """A correct, unoptimized attention backend for mixed prefill + decode batches."""

    name = "torch_paged"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return metadata  # nothing to precompute

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_size)  # [num_slots, kv_heads, head]
        value_cache = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_size)
        key_cache.index_copy_(0, metadata.slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, metadata.slot_mapping, value.to(value_cache.dtype))
        output = torch.empty_like(query)
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_reqs):
            start, end, seq_len = int(starts[i]), int(starts[i + 1]), int(seq_lens[i])
            if end == start:
                continue
            positions = torch.arange(seq_len, device=query.device)
            blocks = metadata.block_table[i].long()[positions // metadata.block_size]
            slots = blocks * metadata.block_size + positions % metadata.block_size  # [seq_len]
            output[start:end] = attend(layer, query[start:end], key_cache[slots], value_cache[slots])
        return output


def attend(
    layer: AttentionLayerSpec,
    query: torch.Tensor,  # [q_len, num_heads, head_size], the last q_len positions
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
) -> torch.Tensor:
    """Causal (and optionally windowed, soft-capped) attention of one request."""
    q_len, seq_len = query.shape[0], key.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    key = key.repeat_interleave(group, dim=1).to(query.dtype)  # [seq_len, num_heads, head_size]
    value = value.repeat_interleave(group, dim=1).to(query.dtype)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * layer.scale  # [heads, q_len, seq_len]
    if layer.logits_soft_cap is not None:
        scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    visible = k_pos <= q_pos  # [q_len, seq_len]
    if layer.sliding_window is not None:
        visible &= k_pos > q_pos - layer.sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value.float()).to(query.dtype)
