"""Rotary embedding in the NeoX ("rotate half") layout, in place on queries and keys."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  HEADS_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    first = base_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = base_ptr.dtype.element_ty
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)


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
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    ok = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, HALF, HALF_PAD, Q_HEADS_PAD)
    _rotate_heads(k_ptr + token * stride_k_tok, stride_k_head, num_k_heads, cos, sin, HALF, HALF_PAD, K_HEADS_PAD)
