"""One-row matrix-vector product ``out = (weight @ x) * scale + bias`` for batch-1 decoding.

Grid ``(cdiv(N, BLOCK_N),)``: a program owns ``BLOCK_N`` output features and streams
their weight rows in ``BLOCK_K`` slices, multiplying by the matching slice of ``x`` and
accumulating ``[BLOCK_N, BLOCK_K]`` partial products in float32; one reduction at the end
gives the outputs. The weight is read once, in full rows, which is all a decode step of
one sequence does (the kernel is bound by memory bandwidth). With ``HAS_SCALE`` the weight
holds 8-bit codes (FP8) and ``scale`` one float32 per row: the dequantized weight's product.

``PROLOGUE`` computes ``x`` from the previous layer's output as each slice is read, saving that
layer's launch (0: ``x`` as given, the plain kernel):

* 1, SiLU-and-mul: ``x_ptr`` holds ``[gate | up]`` (``2 * K``) and ``x = silu(gate) * up``;
* 2, (fused-add) RMSNorm: a first pass over ``x`` (+ ``residual``) takes the mean square (the
  vector is small and stays in L2), then each slice is normalized and scaled by ``norm_w``;
  program 0 also writes ``x + residual`` to ``residual_out``.

Both round as the unfused kernels of ``activation.py`` and ``norm.py`` do.

``GATED`` computes the gated activation after the product instead, for the layer before it: the
weight holds ``2 * N`` rows ``[gate | up]`` (a fused gate/up projection) and the program's rows
``n`` and ``N + n`` give ``out[n] = silu(gate[n]) * up[n]``, each product rounded to the output
dtype first, as the plain kernel followed by ``silu_and_mul`` rounds them. The layer after it then
reads ``N`` values of ``x`` per program instead of computing the activation of ``2 * N``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr,  # [K] (PROLOGUE 1: [2 * K], [gate | up])
    w_ptr,  # [N, K], rows at stride_w
    scale_ptr,  # [N] float32 or unused
    bias_ptr,  # [N] or unused
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_SUMS: tl.constexpr = False,
    residual_ptr=None,  # PROLOGUE 2: [K] added to x before the norm (with HAS_RESIDUAL)
    norm_w_ptr=None,  # PROLOGUE 2: [K] the norm's weight
    residual_out_ptr=None,  # PROLOGUE 2: [K] x + residual, written by program 0 (with HAS_RESIDUAL)
    eps=None,  # PROLOGUE 2: the norm's epsilon
    PROLOGUE: tl.constexpr = 0,
    HAS_RESIDUAL: tl.constexpr = False,
    GEMMA: tl.constexpr = False,
    GATED: tl.constexpr = False,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    up_rows = rows + N * stride_w  # GATED: the up projection's rows
    if PROLOGUE == 2:
        num_stored = tl.where(tl.program_id(0) == 0, K, 0)  # features of x + residual this program stores
        inv_rms = _inv_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, num_stored, HAS_RESIDUAL, BLOCK_K)
    # ROW_SUMS reduces every slice at once (fewer registers, more shuffles).
    acc = tl.zeros([BLOCK_N, 1 if ROW_SUMS else BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, 1 if ROW_SUMS else BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            w_up = tl.load(up_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if PROLOGUE == 0:
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        elif PROLOGUE == 1:
            x = _silu_and_mul_slice(x_ptr, offs_k, k_ok, K)
        else:
            x = _rms_norm_slice(x_ptr, residual_ptr, norm_w_ptr, offs_k, k_ok, inv_rms, HAS_RESIDUAL, GEMMA)
        if ROW_SUMS:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1, keep_dims=True)
            if GATED:
                up_acc += tl.sum(w_up.to(tl.float32) * x.to(tl.float32)[None, :], axis=1, keep_dims=True)
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            if GATED:
                up_acc += w_up.to(tl.float32) * x.to(tl.float32)[None, :]
    out = _finish_rows(acc, scale_ptr, bias_ptr, offs_n, n_ok, HAS_SCALE, HAS_BIAS)
    if GATED:  # each projection rounded as the plain kernel stores it, then silu_and_mul_kernel's rounding
        ty = out_ptr.dtype.element_ty
        up = _finish_rows(up_acc, scale_ptr + N, bias_ptr + N, offs_n, n_ok, HAS_SCALE, HAS_BIAS).to(ty).to(tl.float32)
        gate = out.to(ty).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32) * up
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _finish_rows(acc, scale_ptr, bias_ptr, offs_n, n_ok, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The rows' sums of ``acc`` [BLOCK_N, *] in float32, times their scales, plus their biases."""
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return out


@triton.jit
def _silu_and_mul_slice(x_ptr, offs_k, k_ok, K):
    """``silu(gate) * up`` of one slice, rounded as ``silu_and_mul_kernel`` rounds."""
    gate = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    up = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    ty = gate.dtype
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    return (act * up).to(ty)


@triton.jit
def _residual_sum(x_ptr, residual_ptr, offs_k, k_ok, HAS_RESIDUAL: tl.constexpr):
    """One slice of ``x + residual``, the sum rounded to the activation dtype (as ``rms_norm_kernel``)."""
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + offs_k, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _inv_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, num_stored,
             HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean((x + residual)^2) + eps)`` over the whole vector; stores the sum's first ``num_stored``."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = _residual_sum(x_ptr, residual_ptr, offs_k, k_ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(residual_out_ptr + offs_k, x, mask=offs_k < num_stored)
        xf = x.to(tl.float32)
        squares += xf * xf
    return 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _rms_norm_slice(x_ptr, residual_ptr, norm_w_ptr, offs_k, k_ok, inv_rms,
                    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    """One slice of the norm's output, rounded as ``rms_norm_kernel`` rounds."""
    x = _residual_sum(x_ptr, residual_ptr, offs_k, k_ok, HAS_RESIDUAL)
    ty = x.dtype
    normed = x.to(tl.float32) * inv_rms
    w = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if GEMMA:
        return (normed * (1.0 + w)).to(ty)  # Gemma: scale by 1 + weight, in float32
    return (normed.to(ty).to(tl.float32) * w).to(ty)  # Llama: round, then scale


def _configs(shapes) -> list:
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ROW_SUMS": row_sums}, num_warps=w, num_stages=s)
        for n, k, w, s, row_sums in shapes
    ]


# Two-row programs that reduce every 2048-column slice won the H100 sweep of
# benchmarks/gemv_bench.py for the large layers (gate_up, down, logits) by 3-7 %.
GEMV_CONFIGS = _configs((
    (4, 512, 4, 3, False), (8, 256, 4, 3, False), (8, 512, 4, 3, False), (8, 512, 8, 3, False),
    (16, 256, 4, 3, False), (16, 256, 8, 4, False), (16, 512, 8, 3, False), (32, 128, 4, 4, False),
    (2, 2048, 8, 1, True), (2, 2048, 2, 1, True), (2, 2048, 8, 1, False),
))

# 8-bit weights: twice the columns per byte moved, so longer K slices.
GEMV_8BIT_CONFIGS = _configs((
    (4, 1024, 4, 3, False), (8, 512, 4, 3, False), (8, 1024, 4, 3, False), (8, 1024, 8, 3, False),
    (16, 512, 4, 3, False), (16, 512, 8, 4, False), (16, 1024, 8, 3, False), (32, 256, 4, 4, False),
    (32, 512, 8, 3, False), (4, 1024, 2, 3, False), (2, 2048, 2, 1, True), (2, 2048, 4, 1, True),
))

# The launch shape per (N, K) is measured once per process on the first call (on the
# device; the interpreter runs the plain kernel with a fixed shape instead).
gemv_kernel_tuned = triton.autotune(configs=GEMV_CONFIGS, key=["N", "K"])(gemv_kernel)
gemv_8bit_kernel_tuned = triton.autotune(configs=GEMV_8BIT_CONFIGS, key=["N", "K"])(gemv_kernel)
# The prologue and gated variants tune apart (the same launch shapes to choose from): a layer's (N, K)
# is the same with and without a prologue, and the norm's first pass or the second weight rows move the best shape.
PROLOGUE_KEY = ["N", "K", "PROLOGUE", "HAS_RESIDUAL"]
gemv_prologue_kernel_tuned = triton.autotune(configs=GEMV_CONFIGS, key=PROLOGUE_KEY)(gemv_kernel)
gemv_8bit_prologue_kernel_tuned = triton.autotune(configs=GEMV_8BIT_CONFIGS, key=PROLOGUE_KEY)(gemv_kernel)
gemv_gated_kernel_tuned = triton.autotune(configs=GEMV_CONFIGS, key=PROLOGUE_KEY)(gemv_kernel)
gemv_8bit_gated_kernel_tuned = triton.autotune(configs=GEMV_8BIT_CONFIGS, key=PROLOGUE_KEY)(gemv_kernel)
