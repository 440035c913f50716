"""Decode attention over an FP8 KV cache in CUDA (``cuda/fp8_decode_attention.cu``), which
:func:`runtime_kernels.attention.unified_attention` runs in place of its Triton kernel for steps of decodes
alone (one query token a request) with ``RUNTIME_FP8_DECODE_CUDA=1``: off by default until measured on a GPU.

The Triton kernel pads a request's G query heads (4 for Llama-3-8B) to the 16 rows of a tensor-core dot and
transposes 8-bit tiles into its operands; this one computes on CUDA cores with no padding and no transposition
(the kernel's header says how). Head sizes 64, 128 and 256, 1, 2 or 4 query heads per KV head (8 would spill
registers), a power-of-two block size, 16-bit queries; no softcap or sliding window (the Triton kernel takes them).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from runtime.envs import env_flag

from runtime_kernels import cuda_launch

ENABLED = env_flag("RUNTIME_FP8_DECODE_CUDA", False)
THREADS = 128  # kThreads
QUERY_TYPES = {torch.bfloat16: "gemv_common::bf16", torch.float16: "gemv_common::f16"}
HEAD_SIZES = (64, 128, 256)
GROUPS = (1, 2, 4)
FP8 = getattr(torch, "float8_e4m3fn", None)


@functools.cache
def kernel(device_index: int, query_dtype: torch.dtype, group: int, head_size: int):
    """The compiled kernel for these queries, or None where it does not compile (logged)."""
    name = f"fp8_decode_attention::decode<{QUERY_TYPES[query_dtype]}, {group}, {head_size}>"
    compiled = cuda_launch.compile_kernels(cuda_launch.source("fp8_decode_attention.cu"), [name], device_index)
    return None if compiled is None else compiled[name]


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_tokens: int, num_reqs: int,
             max_query_len: int, sliding_window: int | None, softcap: float | None) -> bool:
    """Whether the kernel takes this step: enabled, decodes alone (token r is request r's one query), an FP8
    e4m3 cache on an sm_89+ GPU, 16-bit queries, a head size and group it is built for, a power-of-two block
    size, 16-byte aligned rows, no sliding window or softcap."""
    if not (ENABLED and FP8 is not None and query.device.type == "cuda" and key_cache.dtype == FP8
            and value_cache.dtype == FP8 and query.dtype in QUERY_TYPES):
        return False
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    return (
        max_query_len == 1 and num_tokens == num_reqs and sliding_window is None and softcap is None
        and head_size in HEAD_SIZES and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads in GROUPS
        and block_size & (block_size - 1) == 0
        and _aligned(query) and _aligned(key_cache) and _aligned(value_cache)
        and cuda_launch.fp8_conversions(index)
        and kernel(index, query.dtype, num_heads // num_kv_heads, head_size) is not None
    )


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     partial: torch.Tensor | None, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                     num_segments: int) -> None:
    """Each request's one query over its keys into ``out`` (one segment), or into ``partial`` [tokens, heads,
    segments, head_size + 2] for ``merge_segments_kernel`` (several). The caller checked :func:`supports`."""
    num_reqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    kern = kernel(query.device.index, query.dtype, group, head_size)
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    args = (
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        partial.data_ptr() if partial is not None else 0, block_table.data_ptr(), seq_lens.data_ptr(), np.float32(scale),
        np.int32(query.stride(0)), np.int32(query.stride(1)), np.int32(out.stride(0)), np.int32(out.stride(1)),
        np.int64(key_cache.stride(0)), np.int32(key_cache.stride(1)), np.int32(key_cache.stride(2)),
        np.int64(value_cache.stride(0)), np.int32(value_cache.stride(1)), np.int32(value_cache.stride(2)),
        np.int32(block_table.stride(0)), np.int32(block_size.bit_length() - 1),
    )
    cuda_launch.launch(kern, (num_reqs, num_kv_heads, num_segments), THREADS, args, 0, query.device)
