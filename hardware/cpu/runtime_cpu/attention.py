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

Compiled decode steps (``runtime_cpu.compile``) trace :meth:`CPUPagedAttentionBackend.traced_decode`
instead: the cache write, the block gather and the attention as plain tensor ops over the
step's block table, which inductor turns into a few C++ loops per layer (every row reads
its whole table width, shorter rows masked).
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


@dataclass(slots=True)
class TracedDecodeInputs:
    """A compiled decode step's metadata as tensors; every size is dynamic (unbacked)."""

    slots: torch.Tensor  # [n] int64, the cache slot of each row's new token
    block_table: torch.Tensor  # [n, width] int64, each row's blocks (columns past its last: any valid id)
    seq_lens: torch.Tensor  # [n] int64, each row's KV length after this step


class CPUPagedAttentionBackend(SdpaAttentionBackend):
    """Attention backend for the ``cpu`` platform (see the module docstring)."""

    name = "cpu_paged"

    def traced_decode_inputs(self, metadata) -> TracedDecodeInputs:
        data: SdpaStepData = metadata.backend_data
        # A fresh row-major copy with at least two columns: the compiled code takes the row
        # stride as the width (a view's row stride is its buffer's), and a width of 1 would be specialized.
        source = data.decode_block_table
        table = torch.empty((source.shape[0], max(2, source.shape[1])), dtype=source.dtype, device=source.device)
        table.copy_(source)  # one column broadcasts into both
        inputs = TracedDecodeInputs(metadata.slot_mapping, table, torch.from_numpy(data.decode_seq_lens))
        mark_unbacked = torch._dynamo.decorators.mark_unbacked  # one compiled step serves every size
        for tensor in (inputs.slots, inputs.block_table, inputs.seq_lens):
            mark_unbacked(tensor, 0)
        mark_unbacked(inputs.block_table, 1)
        return inputs

    def traced_decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [n, num_heads, head_size]
        key: torch.Tensor,  # [n, num_kv_heads, head_size]
        value: torch.Tensor,  # [n, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        inputs: TracedDecodeInputs,
    ) -> torch.Tensor:
        """A decode step's attention as traceable tensor ops (compiled steps only): ``[n, num_heads, head_size]``."""
        n, kv_heads, head = query.shape[0], layer.num_kv_heads, layer.head_size
        for tensor in (inputs.slots, inputs.block_table, inputs.seq_lens):
            torch._check(tensor.shape[0] == n)  # the same rows: lets the compiler equate the sizes
        kv_cache.view(2, -1, kv_heads, head).index_put_(
            (torch.arange(2, device=query.device)[:, None], inputs.slots[None, :]), torch.stack([key, value]).to(kv_cache.dtype)
        )
        # [n, kv_heads, num_keys, head] in float32: keys and values of each row's blocks.
        k = kv_cache[0][inputs.block_table].flatten(1, 2).transpose(1, 2).float()
        v = kv_cache[1][inputs.block_table].flatten(1, 2).transpose(1, 2).float()
        q = query.view(n, kv_heads, -1, 1, head).float() * layer.scale  # [n, kv_heads, group, 1, head]
        scores = (q * k[:, :, None]).sum(-1)  # [n, kv_heads, group, num_keys]
        if layer.logits_soft_cap is not None:
            scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
        positions = torch.arange(k.shape[2], device=query.device)
        lens = inputs.seq_lens[:, None]
        visible = positions < lens
        if layer.sliding_window is not None:
            visible &= positions >= lens - layer.sliding_window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        # Softmax with the division after the weighted sum: once per output, not per key.
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        out = (weights[..., None] * v[:, :, None]).sum(-2) / weights.sum(-1)[..., None]  # [n, kv_heads, group, head]
        return out.reshape(n, layer.num_heads, head).to(query.dtype)

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
        return out.reshape(num_rows, layer.num_heads, layer.head_size)  # SDPA on a GPU may return other strides


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
