"""Paged attention on the CPU, in plain PyTorch.

The KV cache of a layer is ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(keys, then values). A step's batch mixes prefills and decodes:

* every request with one query token (a decode) is served by one padded gather of
  its keys and one batched ``scaled_dot_product_attention`` call;
* every request with several query tokens (a prefill chunk) gets its own SDPA call,
  with an explicit mask only when it has cached context or a sliding window.

The index tensors (which cache slots to gather, which masks to apply) depend only on
the batch layout and the window size, so they are built once per step and window and
shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata, as_cached, write_kv_cache


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar length, served by one block gather and one SDPA call."""

    rows: torch.Tensor  # [n] int64 indices into the step's decode rows
    block_ids: torch.Tensor  # [n * num_blocks] int64 cache blocks to gather, row-major
    num_blocks: int  # blocks gathered per row (padded to the bucket's longest)
    valid: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] bool, None when all keys count


@dataclass(slots=True)
class PrefillRequest:
    """One request with several query tokens: rows ``start:end`` of the batch."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks_of_request] int64


@dataclass(slots=True)
class CPUAttentionData:
    """Per-step layout, built once by :meth:`CPUPagedAttentionBackend.build_metadata`."""

    decode_rows: torch.Tensor  # [num_decodes] int64 batch rows of single-token requests
    decode_seq_lens: np.ndarray  # [num_decodes] int64
    decode_block_table: np.ndarray  # [num_decodes, max_blocks] int64
    prefills: list[PrefillRequest]
    block_size: int
    cache: dict = field(default_factory=dict)  # (kind, index, window) -> gather / mask


class CPUPagedAttentionBackend:
    """Attention backend for the ``cpu`` platform (see module docstring)."""

    name = "cpu_paged"
    supports_fp8_kv_cache = True  # 8-bit caches are read back in the query's dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        block_table = metadata.block_table.to(torch.int64)
        is_decode = q_lens == 1
        prefills = [
            PrefillRequest(int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), block_table[i])
            for i in np.flatnonzero(~is_decode & (q_lens > 0))
        ]
        device = metadata.query_start_loc.device
        metadata.backend_data = CPUAttentionData(
            decode_rows=torch.from_numpy(qsl[:-1][is_decode]).to(device),
            decode_seq_lens=seq_lens[is_decode],
            decode_block_table=block_table.cpu().numpy()[is_decode],
            prefills=prefills,
            block_size=metadata.block_size,
        )
        return metadata

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if not isinstance(metadata.backend_data, CPUAttentionData):
            self.build_metadata(metadata)
        data: CPUAttentionData = metadata.backend_data
        key_cache, value_cache = write_kv_cache(kv_cache, key, value, metadata.slot_mapping)  # [num_slots, kv_heads, head]
        key, value = as_cached(kv_cache, key, value)  # fresh prompts attend their keys as stored

        output = torch.empty_like(query)
        if data.decode_rows.numel():
            buckets = _decode_buckets(data, layer.sliding_window, query.device)
            out = _decode(layer, query[data.decode_rows], kv_cache, buckets)
            output.index_copy_(0, data.decode_rows, out)
        for idx, req in enumerate(data.prefills):
            output[req.start : req.end] = _prefill(layer, query, key, value, key_cache, value_cache, data, idx)
        return output


# Decode rows are sorted by how many blocks they read and split into this many
# groups, so that padding to the longest row of a group wastes little.
NUM_DECODE_BUCKETS = 4


def _decode_buckets(data: CPUAttentionData, window: int | None, device) -> list[DecodeBucket]:
    """Group decode rows by length; each reads whole blocks from its first visible one."""
    cache_key = ("decode", window)
    if cache_key in data.cache:
        return data.cache[cache_key]
    bs, seq_lens, table = data.block_size, data.decode_seq_lens, data.decode_block_table
    first_pos = np.maximum(seq_lens - window, 0) if window is not None else np.zeros_like(seq_lens)
    first_block = first_pos // bs
    num_blocks = (seq_lens - 1) // bs - first_block + 1
    buckets = []
    for part in np.array_split(np.argsort(num_blocks, kind="stable"), min(NUM_DECODE_BUCKETS, len(seq_lens))):
        width = int(num_blocks[part].max())
        cols = first_block[part, None] + np.arange(width)[None, :]  # [n, width] block-table columns
        key_pos = ((cols * bs)[:, :, None] + np.arange(bs)).reshape(len(part), width * bs)
        in_range = (key_pos >= first_pos[part, None]) & (key_pos < seq_lens[part, None])
        # Columns past a row's last block read its first visible block again (real data, masked out).
        cols = np.where(cols < (first_block + num_blocks)[part, None], cols, first_block[part, None])
        ids = np.take_along_axis(table[part], cols, axis=1)
        valid = None if in_range.all() else torch.from_numpy(in_range[:, None, None, :]).to(device)
        buckets.append(
            DecodeBucket(torch.from_numpy(part).to(device), torch.from_numpy(ids.ravel()).to(device), width, valid)
        )
    data.cache[cache_key] = buckets
    return buckets


def _decode(
    layer: AttentionLayerSpec,
    query: torch.Tensor,  # [num_decodes, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_size]
    buckets: list[DecodeBucket],
) -> torch.Tensor:
    num_rows, group = query.shape[0], layer.num_heads // layer.num_kv_heads
    # The query heads of one kv head act as that head's "query length" for SDPA.
    q = query.view(num_rows, layer.num_kv_heads, group, layer.head_size)
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    for bucket in buckets:
        n, num_keys = bucket.rows.numel(), bucket.num_blocks * block_size
        # index_select copies whole blocks: far faster than gathering single slots.
        k = kv_cache[0].index_select(0, bucket.block_ids).view(n, num_keys, layer.num_kv_heads, layer.head_size)
        v = kv_cache[1].index_select(0, bucket.block_ids).view(n, num_keys, layer.num_kv_heads, layer.head_size)
        out[bucket.rows] = _attend(q[bucket.rows], k.transpose(1, 2), v.transpose(1, 2), bucket.valid, layer, is_causal=False)
    return out.view(num_rows, layer.num_heads, layer.head_size)


def _slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of token ``positions`` [rows, n] through ``block_table`` [rows, blocks]."""
    blocks = torch.gather(block_table, 1, positions // block_size)
    return blocks * block_size + positions % block_size


def _prefill(layer, query, key, value, key_cache, value_cache, data: CPUAttentionData, idx: int) -> torch.Tensor:
    """Attention for one request's query rows; returns ``[q_len, num_heads, head_size]``."""
    req = data.prefills[idx]
    q_len = req.end - req.start
    context_len = req.seq_len - q_len  # tokens cached before this step
    window = layer.sliding_window
    first = max(0, context_len - window + 1) if window is not None else 0  # first visible key position
    if context_len == 0:
        k, v = key[req.start + first : req.end], value[req.start + first : req.end]
    else:
        slots = _prefill_slots(data, idx, first)
        k, v = key_cache[slots], value_cache[slots]  # [num_keys, kv_heads, head]
    mask = _prefill_mask(data, idx, context_len, first, window)
    q = query[req.start : req.end].transpose(0, 1)  # [num_heads, q_len, head]
    out = _attend(q, k.transpose(0, 1), v.transpose(0, 1), mask, layer, is_causal=mask is None)
    return out.transpose(0, 1)


def _prefill_slots(data: CPUAttentionData, idx: int, first: int) -> torch.Tensor:
    """``[num_keys]`` cache slots of positions ``first .. seq_len - 1`` of prefill request ``idx``."""
    cache_key = ("prefill_slots", idx, first)
    if cache_key not in data.cache:
        req = data.prefills[idx]
        positions = torch.arange(first, req.seq_len, device=req.block_ids.device)
        data.cache[cache_key] = _slots_of(req.block_ids[None, :], positions[None, :], data.block_size)[0]
    return data.cache[cache_key]


def _prefill_mask(data: CPUAttentionData, idx: int, context_len: int, first: int, window: int | None):
    """``[q_len, num_keys]`` bool mask (causal, bottom-right aligned, windowed), or None for plain causal."""
    req = data.prefills[idx]
    if context_len == 0 and (window is None or req.seq_len <= window):
        return None
    cache_key = ("prefill", idx, window)
    if cache_key not in data.cache:
        q_pos = torch.arange(context_len, req.seq_len)[:, None]
        k_pos = torch.arange(first, req.seq_len)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        data.cache[cache_key] = mask.to(data.decode_rows.device)
    return data.cache[cache_key]


def _attend(q, k, v, mask, layer: AttentionLayerSpec, is_causal: bool) -> torch.Tensor:
    """SDPA over ``[..., heads, q_len, head]`` queries with grouped kv heads.

    ``k``/``v`` have ``num_kv_heads`` heads; ``q`` has a multiple of that (GQA) unless the
    caller already folded the groups into the query length. Soft-capping needs the
    scores, so it takes the explicit path.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless the cache holds 8-bit floats
    if layer.logits_soft_cap is None:
        enable_gqa = q.shape[-3] != k.shape[-3]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=layer.scale, enable_gqa=enable_gqa
        )
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale
    scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
