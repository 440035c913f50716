"""Paged attention on the CPU: core's ``sdpa`` backend with a faster decode path.

Prefill chunks are served as in :class:`runtime.attention.sdpa.SdpaAttentionBackend`.
Decodes (requests with one query token) differ: instead of gathering their keys slot by
slot, the rows are sorted by how many blocks they read and split into a few buckets;
each bucket gathers whole blocks (``index_select``, far faster than single slots on the
CPU) and makes one ``scaled_dot_product_attention`` call, with the query heads of one kv
head folded into the query length. ``benchmarks/RESULTS.md`` has the measured gain.

The buckets depend only on the batch layout and the window size, so they are built once
per step and window and shared by all layers. A single bucket holding every decode row in
order (batch 1, the compiled decode path's usual case) is attended without gathering and
scattering its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.attention.backend import AttentionLayerSpec
from runtime.attention.sdpa import SdpaAttentionBackend, SdpaStepData, attend

# Decode rows are sorted by how many blocks they read and split into this many
# groups, so that padding to the longest row of a group wastes little.
NUM_DECODE_BUCKETS = 4


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar length, served by one block gather and one SDPA call."""

    rows: torch.Tensor | None  # [n] int64 indices into the step's decode rows; None: all of them, in order
    num_rows: int
    block_ids: torch.Tensor  # [n * num_blocks] int64 cache blocks to gather, row-major
    num_blocks: int  # blocks gathered per row (padded to the bucket's longest)
    valid: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] bool, None when all keys count


class CPUPagedAttentionBackend(SdpaAttentionBackend):
    """Attention backend for the ``cpu`` platform (see the module docstring)."""

    name = "cpu_paged"

    def decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        data: SdpaStepData,
    ) -> torch.Tensor:
        num_rows, group = query.shape[0], layer.num_heads // layer.num_kv_heads
        # The query heads of one kv head act as that head's "query length" for SDPA.
        q = query.view(num_rows, layer.num_kv_heads, group, layer.head_size)
        buckets = _decode_buckets(data, layer.sliding_window, query.device)
        out = torch.empty_like(q) if buckets[0].rows is not None else None
        block_size = kv_cache.shape[2]
        for bucket in buckets:
            n, num_keys = bucket.num_rows, bucket.num_blocks * block_size
            k = kv_cache[0].index_select(0, bucket.block_ids).view(n, num_keys, layer.num_kv_heads, layer.head_size)
            v = kv_cache[1].index_select(0, bucket.block_ids).view(n, num_keys, layer.num_kv_heads, layer.head_size)
            if bucket.rows is None:  # the only bucket, every row in order
                out = attend(q, k.transpose(1, 2), v.transpose(1, 2), bucket.valid, layer, is_causal=False)
            else:
                out[bucket.rows] = attend(q[bucket.rows], k.transpose(1, 2), v.transpose(1, 2), bucket.valid, layer, is_causal=False)
        return out.view(num_rows, layer.num_heads, layer.head_size)


def _decode_buckets(data: SdpaStepData, window: int | None, device) -> list[DecodeBucket]:
    """Group decode rows by length; each reads whole blocks from its first visible one."""
    cache_key = ("decode_buckets", 0, window)
    if cache_key in data.cache:
        return data.cache[cache_key]
    bs, seq_lens, table = data.block_size, data.decode_seq_lens, data.decode_block_table.cpu().numpy()
    first_pos = np.maximum(seq_lens - window, 0) if window is not None else np.zeros_like(seq_lens)
    first_block = first_pos // bs
    num_blocks = (seq_lens - 1) // bs - first_block + 1
    buckets = []
    parts = np.array_split(np.argsort(num_blocks, kind="stable"), min(NUM_DECODE_BUCKETS, len(seq_lens)))
    for part in parts:
        width = int(num_blocks[part].max())
        cols = first_block[part, None] + np.arange(width)[None, :]  # [n, width] block-table columns
        key_pos = ((cols * bs)[:, :, None] + np.arange(bs)).reshape(len(part), width * bs)
        in_range = (key_pos >= first_pos[part, None]) & (key_pos < seq_lens[part, None])
        # Columns past a row's last block read its first visible block again (real data, masked out).
        cols = np.where(cols < (first_block + num_blocks)[part, None], cols, first_block[part, None])
        ids = np.take_along_axis(table[part], cols, axis=1)
        valid = None if in_range.all() else torch.from_numpy(in_range[:, None, None, :]).to(device)
        rows = None if len(parts) == 1 and (part == np.arange(len(part))).all() else torch.from_numpy(part).to(device)
        buckets.append(DecodeBucket(rows, len(part), torch.from_numpy(ids.ravel()).to(device), width, valid))
    data.cache[cache_key] = buckets
    return buckets
