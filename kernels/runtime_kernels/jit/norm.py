"""RMSNorm over the last dimension, one row per program, optionally adding a residual first."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]: x + residual (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # Round the sum to the activation dtype, as the unfused model does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, normalized(x, w, hidden, eps, GEMMA).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def normalized(x, w, hidden, eps, GEMMA: tl.constexpr):
    """One row ``x`` (the activations' dtype, zero past ``hidden``) normalized and scaled by ``w``, in float32
    before the last rounding to that dtype: Llama rounds the normalized values first, Gemma scales by
    ``1 + w`` in float32."""
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = xf * inv_rms
    if GEMMA:
        return normed * (1.0 + w.to(tl.float32))
    return normed.to(x.dtype).to(tl.float32) * w.to(tl.float32)
