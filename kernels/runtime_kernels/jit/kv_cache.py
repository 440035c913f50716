"""Write each new token's keys and values into its paged cache slot."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; a negative slot means "skip this token"
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_SIZE)
    src_k = token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst_k = block * stride_kc_block + offset * stride_kc_slot + heads[:, None] * stride_kc_head + dims[None, :]
    dst_v = block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head + dims[None, :]
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
