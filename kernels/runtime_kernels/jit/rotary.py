"""Rotary embedding in the NeoX ("rotate half") layout, in place on queries and keys."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cos_sin(positions_ptr, token, cos_sin_ptr, stride_cache, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The token's cos and sin rows [HALF_PAD], float32."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    ok = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotated_heads(base_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  HEADS_PAD: tl.constexpr):
    """A token's heads rotated, in float32: (first halves, second halves, heads, dims, mask)."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    first = base_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], heads, dims, mask


@triton.jit
def rotate_heads(base_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                 HEADS_PAD: tl.constexpr):
    """A token's heads rotated in place."""
    out1, out2, heads, dims, mask = rotated_heads(base_ptr, stride_head, num_heads, cos, sin, HALF, HALF_PAD, HEADS_PAD)
    first = base_ptr + heads[:, None] * stride_head + dims[None, :]
    out_ty = base_ptr.dtype.element_ty
    tl.store(first, out1.to(out_ty), mask=mask)
    tl.store(first + HALF, out2.to(out_ty), mask=mask)


@triton.jit
def rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    k_ptr,  # [num_tokens, num_k_heads, head_size]
    cos_sin_ptr,  # [max_position, head_size]: cos in the first half, sin in the second
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = cos_sin(positions_ptr, token, cos_sin_ptr, stride_cache, HALF, HALF_PAD)
    rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD)
    rotate_heads(k_ptr + token * stride_k_tok, stride_k_head, num_k_heads, cos, sin, HALF, HALF_PAD, K_HEADS_PAD)
