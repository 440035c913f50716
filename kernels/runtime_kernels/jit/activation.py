"""Gated activation: ``silu(gate) * up`` over ``[gate | up]`` rows."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]
    out_ptr,  # [num_rows, d]
    stride_x,
    stride_o,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, silu_times(gate, up, out_ty).to(out_ty), mask=ok)


@triton.jit
def silu_times(gate, up, act_ty: tl.constexpr):
    """``silu(gate) * up`` (both float32) in float32, silu rounded to the activations' dtype ``act_ty`` before the
    product, as the unfused ops round it."""
    return (gate / (1.0 + tl.exp(-gate))).to(act_ty).to(tl.float32) * up
