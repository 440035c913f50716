"""Write each new token's keys and values into its paged cache slot (after rotating them, or not)."""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.jit.rotary import cos_sin, rotate_heads, rotated_heads


@triton.jit
def reshape_and_cache_kernel(
    positions_ptr,  # [num_tokens] int64 (ROTATE only)
    q_ptr,  # [num_tokens, num_q_heads, head_size], rotated in place (ROTATE only)
    key_ptr,  # [num_tokens, num_kv_heads, head_size], read only: with ROTATE the rotated keys go to the cache
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # the same, or slot-minor within each block (V_SLOT_MINOR): [num_blocks, num_kv_heads, head_size, block_size]
    slot_mapping_ptr,  # [num_tokens] int64; a negative slot: nothing stored (the query is still rotated)
    cos_sin_ptr,  # [max_position, head_size]: cos in the first half, sin in the second (ROTATE only)
    num_q_heads,
    num_kv_heads,
    stride_q_tok,
    stride_q_head,
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
    stride_cos_sin,
    ROTATE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    V_SLOT_MINOR: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    if ROTATE:
        cos, sin = cos_sin(positions_ptr, token, cos_sin_ptr, stride_cos_sin, HALF, HALF_PAD)
        rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_ty = k_cache_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_SIZE)
    k_slot = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    if ROTATE:
        # Keys rounded to their own dtype first, as the separate rotary kernel stores them before the cache write.
        k1, k2, _, half_dims, half_mask = rotated_heads(key_ptr + token * stride_k_tok, stride_k_head, num_kv_heads,
                                                        cos, sin, HALF, HALF_PAD, HEADS_PAD)
        key_ty = key_ptr.dtype.element_ty
        dst_k = k_slot + heads[:, None] * stride_kc_head + half_dims[None, :]
        tl.store(dst_k, k1.to(key_ty).to(cache_ty), mask=half_mask)
        tl.store(dst_k + HALF, k2.to(key_ty).to(cache_ty), mask=half_mask)
    else:
        k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
        tl.store(k_slot + heads[:, None] * stride_kc_head + dims[None, :], k.to(cache_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    v_dims = dims * BLOCK_SIZE if V_SLOT_MINOR else dims  # a dimension's slots are adjacent there
    dst_v = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head + v_dims[None, :]
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
