"""The ``sdpa`` attention backend: the reference paged attention, in plain torch.

The core registers it for every platform: it runs wherever torch runs, faster backends
are tested and timed against it, and plugins build on it (the plugin template's backend
subclasses it; the CPU plugin's ``cpu_paged`` replaces only :meth:`decode`). The KV
cache of a layer is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, then
values). A step's batch mixes prefills and decodes:

* decodes (requests with one query token) are served together: their keys are gathered
  slot by slot into ``[num_decodes, max_seq_len]`` (shorter rows padded and masked) for
  one ``scaled_dot_product_attention`` call;
* each prefill chunk gets its own call, with the chunk's fresh keys when nothing is
  cached before it, else with its visible keys gathered from the cache under an
  explicit mask.

Gather indices and masks depend only on the batch layout and the window size, so they
are built once per step and window and shared by all layers. Soft-capping needs the
scores, so it takes an explicit matmul path.
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
    seq_len: int  # the request's KV length after this step
    block_ids: torch.Tensor  # [max_blocks] int64, the request's row of the block table

    @property
    def context_len(self) -> int:
        """Tokens cached before this step."""
        return self.seq_len - (self.end - self.start)


@dataclass(slots=True)
class SdpaStepData:
    """One step's layout, built once by :meth:`SdpaAttentionBackend.build_metadata`."""

    decode_rows: torch.Tensor  # [num_decodes] int64 batch rows of one-token requests
    decode_seq_lens: np.ndarray  # [num_decodes] int64
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] int64
    prefills: list[PrefillChunk]
    block_size: int
    cache: dict = field(default_factory=dict)  # (kind, index, window) -> gather indices / mask


class SdpaAttentionBackend:
    """Gather-based paged attention for every platform (see the module docstring)."""

    name = "sdpa"
    supports_fp8_kv_cache = True  # 8-bit caches are read back in the query's dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        table = metadata.block_table.long()
        device = table.device
        is_decode = q_lens == 1
        if is_decode.all():  # a decode step: every row, in order, and no prefill
            metadata.backend_data = SdpaStepData(torch.from_numpy(qsl[:-1]).to(device), seq_lens, table, [], metadata.block_size)
            return metadata
        decodes = np.flatnonzero(is_decode)
        metadata.backend_data = SdpaStepData(
            decode_rows=torch.from_numpy(qsl[decodes]).to(device),
            decode_seq_lens=seq_lens[decodes],
            decode_block_table=table[torch.from_numpy(decodes).to(device)],
            prefills=[
                PrefillChunk(int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i]), table[i]) for i in np.flatnonzero(q_lens > 1)
            ],
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
        if not isinstance(metadata.backend_data, SdpaStepData):
            self.build_metadata(metadata)
        data: SdpaStepData = metadata.backend_data
        key_cache, value_cache = write_kv_cache(kv_cache, key, value, metadata.slot_mapping)  # [num_slots, kv_heads, head]
        if not data.prefills and data.decode_rows.numel() == query.shape[0]:
            # Every row a decode, in order: no output scatter (a batch-1 decode step runs this
            # once per layer, where the calls saved are a good part of the step).
            return self.decode(layer, query, kv_cache, data)
        key, value = as_cached(kv_cache, key, value)  # fresh prompts attend their keys as stored
        out = torch.empty_like(query)
        if data.decode_rows.numel():
            out.index_copy_(0, data.decode_rows, self.decode(layer, query[data.decode_rows], kv_cache, data))
        for idx, chunk in enumerate(data.prefills):
            out[chunk.start : chunk.end] = prefill(layer, query, key, value, key_cache, value_cache, data, idx)
        return out

    def decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], this step's keys written
        data: SdpaStepData,
    ) -> torch.Tensor:
        """Attention of the step's one-token requests, ``[num_decodes, num_heads, head_size]``."""
        slots = _decode_slots(data)  # [n, max_len]
        k = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_size)[slots].transpose(1, 2)  # [n, kv_heads, max_len, head]
        v = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_size)[slots].transpose(1, 2)
        mask = _decode_mask(data, layer.sliding_window)
        return attend(query.unsqueeze(2), k, v, mask, layer, is_causal=False).squeeze(2)


def slots_of(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of token ``positions`` [..., n] through block-table rows ``block_ids`` [..., max_blocks]."""
    return block_ids.gather(-1, positions // block_size) * block_size + positions % block_size


def _decode_slots(data: SdpaStepData) -> torch.Tensor:
    """``[num_decodes, max_len]`` slots of every decode row; padding reads valid slots (masked out)."""
    if "decode_slots" not in data.cache:
        table = data.decode_block_table
        positions = torch.arange(int(data.decode_seq_lens.max()), device=table.device)
        # Padding positions past a row's table width would index out of range: clamp them.
        padded = positions.clamp(max=table.shape[1] * data.block_size - 1).expand(table.shape[0], -1)
        data.cache["decode_slots"] = slots_of(table, padded, data.block_size)
    return data.cache["decode_slots"]


def _decode_mask(data: SdpaStepData, window: int | None) -> torch.Tensor:
    """``[n, 1, 1, max_len]``: key positions below each row's length (and inside its window)."""
    cache_key = ("decode_mask", 0, window)
    if cache_key not in data.cache:
        device = data.decode_rows.device
        positions = torch.arange(int(data.decode_seq_lens.max()), device=device)[None, :]
        lens = torch.from_numpy(data.decode_seq_lens).to(device)[:, None]
        mask = positions < lens
        if window is not None:
            mask &= positions >= lens - window
        data.cache[cache_key] = mask[:, None, None, :]
    return data.cache[cache_key]


def prefill(layer, query, key, value, key_cache, value_cache, data: SdpaStepData, idx: int) -> torch.Tensor:
    """One prefill chunk's attention, ``[q_len, num_heads, head_size]``.

    ``key``/``value`` are the step's keys ``[num_tokens, kv_heads, head]``;
    ``key_cache``/``value_cache`` the caches as ``[num_slots, kv_heads, head]``.
    """
    chunk = data.prefills[idx]
    window = layer.sliding_window
    first = max(0, chunk.context_len - window + 1) if window is not None else 0  # first key any query sees
    if chunk.context_len == 0:
        k, v = key[chunk.start : chunk.end], value[chunk.start : chunk.end]  # the fresh keys are all of them
    else:
        slots = _prefill_slots(data, idx, first)
        k, v = key_cache[slots], value_cache[slots]  # [num_keys, kv_heads, head]
    mask = _prefill_mask(data, idx, first, window)
    # A batch dimension of one: on the CPU, 4-d inputs take torch's flash kernel, 3-d ones its math path, which
    # holds every score (an 8k-token prompt of SmolLM2: 5.2 GB and 3.1 s a layer, against 22 MB and 0.35 s).
    q = query[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, q_len, head]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return attend(q, k, v, mask, layer, is_causal=mask is None)[0].transpose(0, 1)


def _prefill_slots(data: SdpaStepData, idx: int, first: int) -> torch.Tensor:
    """``[num_keys]`` cache slots of positions ``first .. seq_len - 1`` of prefill chunk ``idx``."""
    cache_key = ("prefill_slots", idx, first)
    if cache_key not in data.cache:
        chunk = data.prefills[idx]
        positions = torch.arange(first, chunk.seq_len, device=chunk.block_ids.device)
        data.cache[cache_key] = slots_of(chunk.block_ids, positions, data.block_size)
    return data.cache[cache_key]


def _prefill_mask(data: SdpaStepData, idx: int, first: int, window: int | None) -> torch.Tensor | None:
    """``[q_len, num_keys]`` bool mask (causal, aligned to the chunk's end, windowed), or None for plain causal."""
    chunk = data.prefills[idx]
    if chunk.context_len == 0 and (window is None or chunk.seq_len <= window):
        return None
    cache_key = ("prefill_mask", idx, window)
    if cache_key not in data.cache:
        device = chunk.block_ids.device
        q_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device)[:, None]
        k_pos = torch.arange(first, chunk.seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        data.cache[cache_key] = mask
    return data.cache[cache_key]


def attend(q, k, v, mask, layer: AttentionLayerSpec, is_causal: bool) -> torch.Tensor:
    """SDPA of ``q`` [..., heads, q_len, head] over ``k``/``v`` [..., kv_heads, num_keys, head].

    ``mask`` is bool (True = visible) or None; ``is_causal`` asks for causal attention
    instead. ``q`` has a multiple of the kv heads (GQA) unless the caller folded the
    groups into the query length.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-op unless the cache holds 8-bit floats
    if layer.logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=layer.scale, enable_gqa=q.shape[-3] != k.shape[-3]
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
