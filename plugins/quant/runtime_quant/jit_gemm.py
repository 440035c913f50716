"""Triton GEMM of 8-bit activations and weights with their scales: ``out = (a * sa) @ (b * sb).T``.

``a`` [M, K] codes with scales ``sa``: [M, 1] per row, or [M, ceil(K / GROUP_K)] per row and
column group; ``b`` [N, K] codes (row-major, so ``b.T`` is read K-major) with ``sb`` [N] per
row, or [N, ceil(K / GROUP_K)]. With ``GROUP_K`` 0 the dot products accumulate unscaled
(int32 for int8, exact) and both scales apply once at the end; otherwise each K step is one
group (``BLOCK_K == GROUP_K``) and its partial product is scaled before it is added.
"""

from __future__ import annotations

import triton
import triton.language as tl
from runtime_kernels.jit.activation import silu_times  # runtime-kernels' arithmetic of the ops before a layer
from runtime_kernels.jit.norm import normalized


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows and columns of this program's [BLOCK_M, BLOCK_N] output tile, and their masks."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
    """``acc`` (+ ``bias`` per column) into the output tile, in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def scaled_gemm_kernel(
    a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om, stride_sam, stride_sbn,
    HAS_BIAS: tl.constexpr,
    GROUP_K: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    if IS_INT8 and GROUP_K == 0:
        acc_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if GROUP_K == 0:
            if IS_INT8:
                acc_i += tl.dot(a, b)
            else:
                acc += tl.dot(a, b)
        else:
            group = k0 // GROUP_K
            sa = tl.load(sa_ptr + offs_m * stride_sam + group, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + offs_n * stride_sbn + group, mask=n_ok, other=0.0)
            # FP8 codes are exact in float16; float16 dots accumulate in float32 where the
            # FP8 dots of the H200 lost up to one code step in a few outputs.
            acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * sa[:, None] * sb[None, :]
    if GROUP_K == 0:
        if IS_INT8:
            acc = acc_i.to(tl.float32)
        sa = tl.load(sa_ptr + offs_m * stride_sam, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + offs_n * stride_sbn, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)


@triton.jit
def row_quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, static_scale_ptr,
    K, stride_x, stride_codes,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    STATIC: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row of ``x`` to 8-bit codes in QMIN..QMAX (the type's range) and its float32 scale
    (``amax / QMAX``, or the static one)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), QMAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), QMIN), QMAX)  # IEEE division, as torch's
        if ROUND:  # to the nearest integer, ties to even (torch.round)
            r = tl.floor(q + 0.5)
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            q = tl.where(((r - q) == 0.5) & odd, r - 1.0, r)
        tl.store(codes_ptr + row * stride_codes + k0 + offs, q.to(codes_ptr.dtype.element_ty), mask=k0 + offs < K)


@triton.jit
def _quantize_row(y, codes_ptr, scale_ptr, row, stride_codes, cols, ok, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """One whole row ``y`` (float32, already rounded to the activations' dtype) to FP8 codes and its scale
    ``amax / QMAX``, with row_quantize_kernel's arithmetic."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.where(ok, tl.abs(y), 0.0), 0), QMAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -QMAX), QMAX)
    tl.store(codes_ptr + row * stride_codes + cols, q.to(codes_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rms_norm_quantize_kernel(
    x_ptr, residual_ptr, weight_ptr, residual_out_ptr, codes_ptr, scale_ptr,
    hidden, stride_x, stride_r, stride_ro, stride_codes, eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """runtime_kernels' RMSNorm of one row (its roundings: the sum with the residual, then Llama's
    normalized value or Gemma's product, in the activations' dtype), then the row's FP8 codes and scale,
    in one launch: the norm's output never goes to memory."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    act_ty = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(act_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    y = normalized(x, tl.load(weight_ptr + cols, mask=ok, other=0.0), hidden, eps, GEMMA)
    _quantize_row(y.to(act_ty).to(tl.float32), codes_ptr, scale_ptr, row, stride_codes, cols, ok, QMAX, MIN_SCALE)


@triton.jit
def silu_and_mul_quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, d, stride_x, stride_codes,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """runtime_kernels' ``silu(gate) * up`` of one row of ``[gate | up]`` (silu rounded to the activations'
    dtype before the product, the product rounded), then its FP8 codes and scale, in one launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    act_ty = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    _quantize_row(silu_times(gate, up, act_ty).to(act_ty).to(tl.float32), codes_ptr, scale_ptr, row, stride_codes, cols, ok, QMAX,
                  MIN_SCALE)
