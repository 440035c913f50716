"""The ``sdpa`` attention backend: gather the paged keys, then torch's SDPA.

A simple and obviously correct fallback for the Triton kernel (and a baseline to time
it against). It works on any device torch runs on:

* decodes (requests with one query token) are served together: their keys are gathered
  into ``[num_decodes, max_seq_len]`` (shorter rows padded and masked) for one
  ``scaled_dot_product_attention`` call;
* each prefill chunk gets its own call, with the chunk's fresh keys when nothing is
  cached before it, else its keys gathered from the cache under an explicit mask.

The gather indices depend only on the batch layout, so they are built once per step in
:meth:`SdpaAttentionBackend.build_metadata`; masks are built once per step and window.
Soft-capping needs the scores, so it takes an explicit matmul path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata, as_cached, write_kv_cache


@dataclass(slots=True)
class PrefillChunk:
    """Rows ``start:end`` of the batch: one request's query tokens."""

    start: int
    end: int
    context_len: int  # tokens cached before this step
    slots: torch.Tensor  # [seq_len] int64 cache slots of positions 0 .. seq_len - 1


@dataclass(slots=True)
class SdpaStepData:
    decode_rows: torch.Tensor  # [num_decodes] int64 batch rows of one-token requests
    decode_slots: torch.Tensor  # [num_decodes, max_len] int64 cache slots (padding reads valid slots)
    decode_seq_lens: torch.Tensor  # [num_decodes] int64
    prefills: list[PrefillChunk]
    masks: dict = field(default_factory=dict)  # (kind, index, window) -> bool mask


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of ``positions`` [..., n] through ``block_table`` rows [..., max_blocks]."""
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


class SdpaAttentionBackend:
    """Gather-based paged attention (see the module docstring)."""

    name = "sdpa"
    supports_fp8_kv_cache = True  # 8-bit caches are read back in the query's dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        table = metadata.block_table.long()
        device, bs = table.device, metadata.block_size
        decodes = np.flatnonzero(q_lens == 1)
        max_len = int(seq_lens[decodes].max()) if decodes.size else 0
        positions = torch.arange(max_len, device=device)
        # Padding positions past a row's table width would index out of range: clamp them.
        padded = positions.clamp(max=table.shape[1] * bs - 1).expand(len(decodes), max_len)
        prefills = [
            PrefillChunk(int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i] - q_lens[i]),
                         _slots(table[i], torch.arange(int(seq_lens[i]), device=device), bs))
            for i in np.flatnonzero(q_lens > 1)
        ]
        metadata.backend_data = SdpaStepData(
            decode_rows=torch.from_numpy(qsl[decodes]).to(device),
            decode_slots=_slots(table[torch.from_numpy(decodes).to(device)], padded, bs),
            decode_seq_lens=torch.from_numpy(seq_lens[decodes]).to(device),
            prefills=prefills,
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
        if not isinstance(metadata.backend_data, SdpaStepData):
            self.build_metadata(metadata)
        data: SdpaStepData = metadata.backend_data
        key_cache, value_cache = write_kv_cache(kv_cache, key, value, metadata.slot_mapping)  # [num_slots, kv_heads, head]
        key, value = as_cached(kv_cache, key, value)  # fresh prompts attend their keys as stored
        out = torch.empty_like(query)
        if data.decode_rows.numel():
            k = key_cache[data.decode_slots].transpose(1, 2)  # [n, kv_heads, max_len, head]
            v = value_cache[data.decode_slots].transpose(1, 2)
            q = query[data.decode_rows].unsqueeze(2)  # [n, heads, 1, head]
            mask = _decode_mask(data, layer.sliding_window)
            out[data.decode_rows] = _attend(q, k, v, mask, layer).squeeze(2)
        for idx, chunk in enumerate(data.prefills):
            out[chunk.start : chunk.end] = _prefill(layer, query, key, value, key_cache, value_cache, data, idx)
        return out


def _decode_mask(data: SdpaStepData, window: int | None) -> torch.Tensor:
    """``[n, 1, 1, max_len]``: key positions below each row's length (and inside its window)."""
    cache_key = ("decode", 0, window)
    if cache_key not in data.masks:
        positions = torch.arange(data.decode_slots.shape[1], device=data.decode_slots.device)[None, :]
        lens = data.decode_seq_lens[:, None]
        mask = positions < lens
        if window is not None:
            mask &= positions >= lens - window
        data.masks[cache_key] = mask[:, None, None, :]
    return data.masks[cache_key]


def _prefill(layer, query, key, value, key_cache, value_cache, data: SdpaStepData, idx: int) -> torch.Tensor:
    """One chunk's attention, ``[q_len, num_heads, head_size]``."""
    chunk = data.prefills[idx]
    q = query[chunk.start : chunk.end].transpose(0, 1)  # [heads, q_len, head]
    if chunk.context_len == 0:
        k, v = key[chunk.start : chunk.end], value[chunk.start : chunk.end]  # the fresh keys are all of them
    else:
        k, v = key_cache[chunk.slots], value_cache[chunk.slots]  # [seq_len, kv_heads, head]
    mask = _prefill_mask(data, idx, layer.sliding_window, q.device)
    return _attend(q, k.transpose(0, 1), v.transpose(0, 1), mask, layer).transpose(0, 1)


def _prefill_mask(data: SdpaStepData, idx: int, window: int | None, device) -> torch.Tensor | None:
    """``[q_len, seq_len]`` causal mask aligned to the chunk's end, or None for plain causal."""
    chunk = data.prefills[idx]
    if chunk.context_len == 0 and window is None:
        return None
    cache_key = ("prefill", idx, window)
    if cache_key not in data.masks:
        seq_len = chunk.slots.shape[0]
        q_pos = torch.arange(chunk.context_len, seq_len, device=device)[:, None]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        data.masks[cache_key] = mask
    return data.masks[cache_key]


def _attend(q, k, v, mask, layer: AttentionLayerSpec) -> torch.Tensor:
    """Attention of ``q`` [..., heads, q_len, d] over ``k``/``v`` [..., kv_heads, n, d].

    ``mask`` (bool, True = visible) or, when None, causal attention.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless the cache holds 8-bit floats
    if layer.logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scale
    scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
