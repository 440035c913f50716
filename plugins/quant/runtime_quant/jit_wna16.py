"""Triton kernels of weight-only 4/8-bit layers in the canonical layout of
:mod:`runtime_quant.wna16_kernels`: ``out = x @ ((q - zeros) * scales) (+ bias)``.

``qw`` [K / PACK, N] int32 words (code ``k`` of column ``n`` at bits ``BITS * (k % PACK)`` of
word ``k // PACK``), ``scales`` float32 and ``zeros`` uint8 [groups, N], ``GROUP_ROWS`` input
rows per group. Both kernels read a [BLOCK_K / PACK, BLOCK_N] tile of words and shift it
into [PACK, BLOCK_K / PACK, BLOCK_N] codes: slice ``p`` holds the codes at bit ``BITS * p``
of each word, so the tile's code order is "shift-major" (``k = k0 + w * PACK + p`` at
position ``p * KW + w``). Instead of interleaving the codes back into K order in registers,
the GEMV loads ``x``'s columns in that same order (a gather from a tiny, cached vector).
A K block never straddles two groups (the caller picks ``BLOCK_K`` dividing ``GROUP_ROWS``,
or there is one group), so each block has one row of scales and zero points.

- :func:`wna16_gemv_kernel` (decode, up to 4 rows, all rows in one program so the weights
  are read once): per K block ``scale * (x . q - zero * sum(x))``, so a weight costs one
  shift, mask, convert and multiply-add. Split along K for small layers; each split stores
  its partial sums and the last split to finish a column block (an atomic counter that it
  resets) adds them in split order and writes the output: deterministic, and no zeroing or
  conversion kernel around the call.
- :func:`wna16_gemm_kernel` (prefill): the dequantized tile feeds ``tl.dot`` (tensor cores)
  against a [BLOCK_M, BLOCK_K] tile of ``x``.
- :func:`wna16_dequantize_kernel` (large batches): the layer's weights ``W.T`` [K, N] written out
  in the activations' dtype, for cuBLAS to multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_quant.jit_gemm import store_tile, tile_offsets


@triton.jit
def _shift_major_codes(qw_ptr, k0, K, stride_qk, offs_n, n_ok,
                       BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The codes of rows ``k0 .. k0 + BLOCK_K``, [PACK, BLOCK_K / PACK, BLOCK_N] int32 (0 past K)."""
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK
    offs_w = k0 // PACK + tl.arange(0, KW)
    words = tl.load(qw_ptr + offs_w.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                    mask=(offs_w < K // PACK)[:, None] & n_ok[None, :], other=0)  # [KW, BLOCK_N]
    shifts = tl.arange(0, PACK) * BITS
    return (words[None, :, :] >> shifts[:, None, None]) & ((1 << BITS) - 1)


@triton.jit
def _shift_major_k(k0, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The input row of each position of a shift-major tile: [PACK, BLOCK_K / PACK]."""
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK
    return k0 + tl.arange(0, KW)[None, :] * PACK + tl.arange(0, PACK)[:, None]


@triton.jit
def _group_row(ptr, k0, GROUP_ROWS, stride_sg, offs_n, n_ok):
    return tl.load(ptr + (k0 // GROUP_ROWS) * stride_sg + offs_n, mask=n_ok, other=0).to(tl.float32)


@triton.jit
def store_split_k(acc, out_ptr, bias_ptr, part_ptr, lock_ptr, rows, offs_n, m_ok, n_ok, N, stride_om,
                  num_splits, HAS_BIAS: tl.constexpr):
    """A GEMV program's sums ``acc`` [BLOCK_M, BLOCK_N] of its K range (program (column block, split)):
    the output tile directly when there is one split; else its partial sums into ``part_ptr``
    [num_splits, BLOCK_M, N], and the last split to finish its column block (the counter at
    ``lock_ptr``, which it resets) adds them in split order and stores the tile. ``num_splits``
    may be a constexpr (one compiled branch) or a runtime value (fewer compiled variants)."""
    if num_splits == 1:
        store_tile(acc, out_ptr, bias_ptr, rows, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)
    else:
        BLOCK_M: tl.constexpr = acc.shape[0]
        pid_n = tl.program_id(0)
        tl.store(part_ptr + (rows + tl.program_id(1) * BLOCK_M)[:, None] * N + offs_n[None, :], acc, mask=n_ok[None, :])
        tl.debug_barrier()  # every thread's partial sums are out before the counter moves
        if tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel") == num_splits - 1:
            total = tl.zeros_like(acc)
            for s in range(num_splits):
                total += tl.load(part_ptr + (rows + s * BLOCK_M)[:, None] * N + offs_n[None, :],
                                 mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
            store_tile(total, out_ptr, bias_ptr, rows, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next call


@triton.jit
def wna16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, GROUP_ROWS, K_PER_SPLIT,
    stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    m_ok = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        codes = _shift_major_codes(qw_ptr, k0, K, stride_qk, offs_n, n_ok, BITS, BLOCK_K, BLOCK_N).to(tl.float32)
        ks = _shift_major_k(k0, BITS, BLOCK_K)
        scale = _group_row(s_ptr, k0, GROUP_ROWS, stride_sg, offs_n, n_ok)
        zero = _group_row(z_ptr, k0, GROUP_ROWS, stride_sg, offs_n, n_ok)
        for r in tl.static_range(BLOCK_M):
            # rows past M (BLOCK_M is a power of two) repeat the last one and are not stored
            x = tl.load(x_ptr + tl.minimum(r, M - 1) * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
            xq = tl.sum(tl.sum(x[:, :, None] * codes, axis=1), axis=0)  # [BLOCK_N]
            part = scale * (xq - zero * tl.sum(tl.sum(x, axis=1), axis=0))
            acc = tl.where(rows[:, None] == r, acc + part[None, :], acc)
    store_split_k(acc, out_ptr, bias_ptr, part_ptr, lock_ptr, rows, offs_n, m_ok, n_ok, N, stride_om,
                  SPLIT_K, HAS_BIAS)


@triton.jit
def _k_order_weights(qw_ptr, s_ptr, z_ptr, k0, K, GROUP_ROWS, stride_qk, stride_sg, offs_n, n_ok,
                     BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``k0 .. k0 + BLOCK_K`` of ``W.T``, in K order: ``(q - zero) * scale`` [BLOCK_K, BLOCK_N] float32."""
    codes = _shift_major_codes(qw_ptr, k0, K, stride_qk, offs_n, n_ok, BITS, BLOCK_K, BLOCK_N)
    codes = tl.reshape(tl.permute(codes, (1, 0, 2)), (BLOCK_K, BLOCK_N))
    scale = _group_row(s_ptr, k0, GROUP_ROWS, stride_sg, offs_n, n_ok)
    zero = _group_row(z_ptr, k0, GROUP_ROWS, stride_sg, offs_n, n_ok)
    return (codes.to(tl.float32) - zero[None, :]) * scale[None, :]


@triton.jit
def wna16_dequantize_kernel(
    qw_ptr, s_ptr, z_ptr, out_ptr,
    N, K, GROUP_ROWS,
    stride_qk, stride_sg, stride_ok,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = _k_order_weights(qw_ptr, s_ptr, z_ptr, k0, K, GROUP_ROWS, stride_qk, stride_sg, offs_n, n_ok,
                         BITS, BLOCK_K, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_k < K)[:, None] & n_ok[None, :])


@triton.jit
def wna16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, GROUP_ROWS,
    stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        # the codes back in K order: the dot's operand wants contiguous x columns (a gathered x tile
        # made this GEMM 2-4x slower on an H200)
        w = _k_order_weights(qw_ptr, s_ptr, z_ptr, k0, K, GROUP_ROWS, stride_qk, stride_sg, offs_n, n_ok,
                             BITS, BLOCK_K, BLOCK_N)
        if IEEE:  # float32 products, no TF32 rounding
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:  # 16-bit tensor-core dots
            acc += tl.dot(x, w.to(x.dtype))
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)
