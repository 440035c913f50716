"""The ``triton`` attention backend: this package's unified paged attention.

One ``reshape_and_cache`` launch writes the step's new keys and values (rotating the
queries and keys first when the layer hands its rotation over), then one
``unified_attention`` launch serves every request of the step, prefill chunks and
decodes alike (small decode-only batches split each request's keys over several
programs). The kernels read only device tensors of the metadata, plus the host-side
``max_query_len`` / ``max_seq_len`` that pick the launch shape, so the step needs no
host synchronization.

A step of prefill chunks and decodes whose first requests are decodes (the scheduler
runs the older, decoding requests first) takes two launches: the decodes with the
decode programs (one a request and KV head, a few score rows), the rest with the prefill
tiles. In one launch each decode would take a whole prefill program of 64 score rows for
its one query, which in W2's mixed steps (~500 decodes beside 16k prompt tokens) cost as
much work as the prompts themselves. ``RUNTIME_TRITON_SPLIT_DECODES=0``: one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
from runtime.envs import env_flag
from runtime_kernels.attention import unified_attention
from runtime_kernels.kv_cache import reshape_and_cache, rotary_reshape_and_cache, slot_minor


@dataclass(frozen=True, slots=True)
class DecodesFirst:
    """A mixed step whose first ``num_decodes`` requests are decodes: the rest's query offsets from 0."""

    num_decodes: int
    # The rest's metadata as fresh tensors: slices at odd offsets would lose Triton's 16-byte alignment
    # specialization and compile the kernel again for each alignment the offsets happen to give.
    rest_query_start_loc: torch.Tensor  # [num_reqs - num_decodes + 1] int32, from 0
    rest_seq_lens: torch.Tensor
    rest_block_table: torch.Tensor


def leading_decodes(query_start_loc_cpu: np.ndarray | None) -> int:
    """How many requests at the front of the batch have one query token (0 without host offsets)."""
    if query_start_loc_cpu is None or len(query_start_loc_cpu) < 2:
        return 0
    longer = np.flatnonzero(np.diff(query_start_loc_cpu) != 1)
    return int(longer[0]) if len(longer) else len(query_start_loc_cpu) - 1


class TritonAttentionBackend:
    """Paged attention for the GPU platforms (cuda, rocm, xpu); KV layout as every other backend's."""

    name = "triton"
    supports_graphs = True  # reads only device tensors and launch-shape sizes fixed per captured batch
    supports_fp8_kv_cache = True  # the kernels convert on store and load
    # the rotary embedding and the cache write in one launch (RUNTIME_TRITON_FUSED_ROTARY=0: two)
    fuses_rotary = env_flag("RUNTIME_TRITON_FUSED_ROTARY")
    # An 8-bit cache keeps its values slot-minor within each block (kv_cache.slot_minor): the decode attention
    # then loads them in runs of bytes (W2's layer 241 -> 197 us on an H200, benchmarks/RESULTS.md). The block
    # bytes are the same, so block copies (offload, disaggregation) move them unchanged. RUNTIME_FP8_V_SLOT_MINOR=0:
    # the usual layout.
    slot_minor_values = env_flag("RUNTIME_FP8_V_SLOT_MINOR")
    split_decodes = env_flag("RUNTIME_TRITON_SPLIT_DECODES")
    # Step block tables of whole multiples of 16 columns: their row stride is a kernel argument, which Triton
    # specializes by divisibility, so any other width would compile the kernels again (runtime.worker.input_batch).
    block_table_width_multiple = 16

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def kv_block_layout(self, cache_dtype: torch.dtype) -> str:
        """An 8-bit cache's values are slot-minor in each block unless RUNTIME_FP8_V_SLOT_MINOR=0."""
        return "values-slot-minor" if self.slot_minor_values and cache_dtype.itemsize == 1 else ""

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        if self.split_decodes and metadata.max_query_len > 1:
            num_decodes = leading_decodes(metadata.query_start_loc_cpu)
            if 0 < num_decodes < metadata.num_reqs:
                metadata.backend_data = DecodesFirst(
                    num_decodes, metadata.query_start_loc[num_decodes:] - num_decodes,
                    metadata.seq_lens[num_decodes:].clone(), metadata.block_table[num_decodes:].clone())
        return metadata

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        rotation=None,  # runtime.models.rotary.FusedRotation, or None: query and key come rotated
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.kv_block_layout(value_cache.dtype):
            value_cache = slot_minor(value_cache)
        if rotation is None:
            reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        else:
            rotary_reshape_and_cache(rotation.positions, query, key, value, key_cache, value_cache,
                                     metadata.slot_mapping, rotation.cos_sin_cache)
        out = torch.empty_like(query)
        split = metadata.backend_data
        if not isinstance(split, DecodesFirst):
            return unified_attention(
                query, key_cache, value_cache, out, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                metadata.max_query_len, layer.scale, layer.sliding_window, layer.logits_soft_cap,
                max_seq_len=metadata.max_seq_len,
            )
        n = split.num_decodes  # request i < n is token i
        unified_attention(
            query[:n], key_cache, value_cache, out[:n], metadata.query_start_loc[: n + 1], metadata.seq_lens[:n],
            metadata.block_table[:n], 1, layer.scale, layer.sliding_window, layer.logits_soft_cap,
            max_seq_len=metadata.max_seq_len,
        )
        unified_attention(
            query[n:], key_cache, value_cache, out[n:], split.rest_query_start_loc, split.rest_seq_lens,
            split.rest_block_table, metadata.max_query_len, layer.scale, layer.sliding_window,
            layer.logits_soft_cap, max_seq_len=metadata.max_seq_len,
        )
        return out
