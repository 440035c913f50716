"""One-row matrix-vector product ``out = (weight @ x) * scale + bias`` for batch-1 decoding.

Grid ``(cdiv(N, BLOCK_N),)``: a program owns ``BLOCK_N`` output features and streams
their weight rows in ``BLOCK_K`` slices, multiplying by the matching slice of ``x`` and
accumulating ``[BLOCK_N, BLOCK_K]`` partial products in float32; one reduction at the end
gives the outputs. The weight is read once, in full rows, which is all a decode step of
one sequence does (the kernel is bound by memory bandwidth). With ``HAS_SCALE`` the weight
holds 8-bit codes (FP8) and ``scale`` one float32 per row: the dequantized weight's product.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr,  # [K]
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
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    # ROW_SUMS reduces every slice at once (fewer registers, more shuffles).
    acc = tl.zeros([BLOCK_N, 1 if ROW_SUMS else BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        if ROW_SUMS:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1, keep_dims=True)
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


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
