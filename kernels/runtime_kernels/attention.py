"""Paged attention for mixed prefill + decode batches, and its plain-torch reference.

KV cache layout (the same as the CPU plugin's): one tensor per layer,
``[2, num_blocks, block_size, num_kv_heads, head_size]``, keys then values; callers pass
``kv_cache[0]`` and ``kv_cache[1]``. Any strides work as long as ``head_size`` is the
contiguous dimension, or the value cache is slot-minor (:func:`runtime_kernels.kv_cache.slot_minor`).

Each request's queries are its last ``q_len`` positions (``q_len`` from
``query_start_loc``), causal among themselves, over all ``seq_len`` cached keys; a
sliding window of ``w`` lets a query see the ``w`` positions ending at its own.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from runtime.envs import env_ints

from runtime_kernels.kv_cache import check_value_cache, is_slot_minor
from runtime_kernels.utils import check_last_dim_contiguous, interpreting, next_power_of_2, require_triton

MAX_HEAD_SIZE = 512
MAX_SEGMENTS = 16
MIN_TILES_PER_SEGMENT = 4


def _tiles_setting(name: str) -> tuple[int, int, int] | None:
    """``keys,warps,stages`` from the environment variable ``name`` (None when unset)."""
    tiles = env_ints(name, 3)
    if tiles is None:
        return None
    keys, warps, stages = tiles
    if keys < 16 or keys != next_power_of_2(keys) or warps < 1 or warps != next_power_of_2(warps) or stages < 1:
        raise ValueError(f"{name}={os.environ[name]!r}: it takes keys,warps,stages (e.g. 64,1,3): keys a power of "
                         "two >= 16, warps a power of two, stages >= 1")
    return keys, warps, stages


# The tiles of decode steps over an 8-bit cache (keys a step, warps, stages), for sweeps in the engine.
FP8_DECODE_TILES = _tiles_setting("RUNTIME_FP8_DECODE_TILES")


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Launch shape of :func:`unified_attention`."""

    block_m: int  # score rows per program: block_q query tokens x the head group
    block_q: int  # query tokens per program
    tile_n: int  # key positions per inner-loop step
    num_warps: int
    num_stages: int


def attention_tiles(max_query_len: int, num_queries_per_kv: int, head_size: int, cache_bytes: int = 2,
                    values_slot_minor: bool = False) -> AttentionTiles:
    """Small programs for decode-only batches (and the few queries per request of speculative
    verification), larger ones when prefill chunks are present.

    Decode over an 8-bit cache (``cache_bytes`` 1) whose values are slot-minor takes 64 keys a
    step with one warp and three stages; with the usual value layout, twice the keys with two
    warps: the fastest in the H200 sweeps of benchmarks/RESULTS.md
    (``RUNTIME_FP8_DECODE_TILES=keys,warps,stages`` sets others). Prefill chunks over an 8-bit cache
    take 128 score rows a program where heads of at most 128 allow (W2's prompts on an H200: 651
    against 815 us a layer at 64 rows; a 16-bit cache is faster at 64).
    """
    head_pad = next_power_of_2(max(head_size, 16))
    rows_needed = max_query_len * num_queries_per_kv
    rows = 16 if rows_needed <= 16 else 32 if rows_needed <= 32 else (64 if head_pad <= 128 else 32)
    if cache_bytes == 1 and head_pad <= 128 and rows_needed > 64:
        rows = 128
    block_m = max(rows, next_power_of_2(num_queries_per_kv))
    tile_n = 64 if head_pad <= 128 else 32
    if cache_bytes == 1 and max_query_len == 1:
        keys, warps, stages = FP8_DECODE_TILES or ((tile_n, 1, 3) if values_slot_minor else (2 * tile_n, 2, 3))
        return AttentionTiles(block_m, block_m // num_queries_per_kv, keys, num_warps=warps, num_stages=stages)
    return AttentionTiles(block_m, block_m // num_queries_per_kv, tile_n, num_warps=4, num_stages=2)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend an H100
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_segments(
    max_query_len: int, max_seq_len: int | None, num_reqs: int, num_kv_heads: int, tile_n: int, device: torch.device,
    block_q: int = 1,
) -> int:
    """Split-KV segments for batches whose programs would not fill the GPU (else 1): decode-only
    steps, and steps whose requests' queries each fit one program's ``block_q`` (speculative
    verification), so that a request has one program per kv head."""
    if max_query_len > max(block_q, 1) or not max_seq_len:
        return 1
    programs, target = num_reqs * num_kv_heads, 2 * _num_sms(device)
    if programs >= target:
        return 1
    by_occupancy = next_power_of_2(-(-target // programs))
    by_length = max(1, max_seq_len // (tile_n * MIN_TILES_PER_SEGMENT))
    by_length = 1 << (by_length.bit_length() - 1)  # round down to a power of two
    return min(MAX_SEGMENTS, by_occupancy, by_length)


def unified_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], or a kv_cache.slot_minor view
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Attention of every scheduled token over its request's paged keys; returns ``out``.

    ``max_query_len`` bounds every request's queries this step; at 1 the launch takes one
    program per request and KV head, which serves only one query a request. ``max_seq_len``
    lets small decode batches split each request's keys over several programs
    (``num_segments``, a power of two, overrides the choice).
    """
    require_triton("unified_attention")
    from runtime_kernels.jit.attention import merge_segments_kernel, unified_attention_kernel

    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} is larger than the kernel's maximum {MAX_HEAD_SIZE}")
    for name, t in (("query", query), ("key_cache", key_cache), ("out", out)):
        check_last_dim_contiguous(name, t)
    check_value_cache("value_cache", value_cache)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    v_slot_minor = is_slot_minor(value_cache)
    tiles = attention_tiles(max_query_len, num_heads // num_kv_heads, head_size, key_cache.element_size(), v_slot_minor)
    head_pad = next_power_of_2(max(head_size, 16))
    if num_segments is None:
        num_segments = num_kv_segments(max_query_len, max_seq_len, num_reqs, num_kv_heads, tiles.tile_n, query.device,
                                       tiles.block_q)
    if num_segments != next_power_of_2(num_segments):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    f16_dots = key_cache.element_size() == 1 and query.dtype in (torch.bfloat16, torch.float16)
    partial = out  # unused without split-KV
    if num_segments > 1:
        partial = torch.empty(num_tokens, num_heads, num_segments, head_pad + 2, dtype=torch.float32, device=out.device)
    decode = max_query_len == 1  # a program per request (the kernel's DECODE)
    grid = (num_reqs if decode else num_tokens // tiles.block_q + num_reqs, num_kv_heads, num_segments)
    unified_attention_kernel[grid](
        query, key_cache, value_cache, out, partial, block_table, seq_lens, query_start_loc,
        float(scale), float(softcap or 0.0), int(sliding_window or 0), num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=tiles.tile_n,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        # float32 models get full-precision dots; TF32 would cost ~3 decimal digits.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=query.dtype == torch.bfloat16 and interpreting() and not f16_dots,
        F16_DOTS=f16_dots,
        NUM_SEGMENTS=num_segments,
        DECODE=decode,
        V_SLOT_MINOR=v_slot_minor,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_segments > 1:
        merge_segments_kernel[(num_tokens, num_heads)](
            partial, out, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments,
        )
    return out


def unified_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    seq_lens: torch.Tensor,  # [num_reqs]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same attention, one request at a time, in float32; returns ``query``'s shape and dtype."""
    num_heads, block_size = query.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for req, seq_len in enumerate(lens):
        start, end = starts[req], starts[req + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_table[req].long()[positions // block_size]
        k = key_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)  # [seq, heads, d]
        v = value_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = positions[seq_len - (end - start) :, None]  # [q_len, 1]
        visible = positions[None, :] <= q_pos
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
