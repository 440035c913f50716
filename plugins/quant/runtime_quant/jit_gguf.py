"""Triton kernels over llama.cpp's quantized blocks, dequantized in the kernel: ``out = x @ W.T``.

``w_ptr`` is the layer's raw rows, uint8 [N, row bytes] (:mod:`runtime_quant.gguf_blocks`
has the seven layouts). :func:`dequant_tile` turns the bytes of ``BLOCK_N`` rows and any
``BLOCK_K`` input columns into float32 weights: each column ``k`` lies in block ``k // QK`` at
position ``k % QK``, so a K step may cover several small blocks (Q*_0, 32 inputs) or part of a
super-block (K-quants, 256). Codes, scales and offsets are read from the block's bytes and
combined in gguf-py's order of operations (a compiler may still fuse a multiply-add).

- :func:`gguf_gemv_kernel` (decode, up to 4 rows of ``x``, all in one program so a weight
  tile is read once): split along K; each split writes float32 partial sums
  [SPLIT_K, BLOCK_M, N] that the caller adds (or the output directly when SPLIT_K is 1);
- :func:`gguf_gemm_kernel` (prefill): the dequantized tile feeds ``tl.dot`` (tensor cores in
  16-bit) against a [BLOCK_M, BLOCK_K] tile of ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_quant.jit_gemm import store_tile, tile_offsets

Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """A little-endian float16 at ``ptr`` (two bytes), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(qs, j, mask):
    """Code ``j`` (0..31) of a 16-byte run of nibbles: low nibbles first, then high."""
    return (_byte(qs + (j % 16), mask) >> ((j // 16) * 4)) & 15


@triton.jit
def _k_scale_min(s, sub, mask):
    """6-bit scale and min of sub-block ``sub`` (0..7) from a K-quant's 12 scale bytes at ``s``."""
    a = _byte(s + sub % 4, mask)
    b = _byte(s + sub % 4 + 4, mask)
    c = _byte(s + sub % 4 + 8, mask)
    low = sub < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_nibble(qs, j, mask):
    """Code ``j`` (0..255) of a K-quant's 128 bytes of nibbles (64-input chunks of 32 bytes)."""
    w = j % 64
    return (_byte(qs + (j // 64) * 32 + w % 32, mask) >> ((w // 32) * 4)) & 15


@triton.jit
def dequant_tile(w_ptr, offs_n, n_ok, k, K, stride_wn, TYPE: tl.constexpr):
    """Weights of rows ``offs_n`` [BLOCK_N] at input columns ``k`` [BLOCK_K]: [BLOCK_N, BLOCK_K] float32
    (0 outside the matrix)."""
    mask = n_ok[:, None] & (k < K)[None, :]
    row = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if TYPE == Q4_0 or TYPE == Q4_1 or TYPE == Q5_0 or TYPE == Q8_0:
        j = (k % 32)[None, :]
        if TYPE == Q4_0:
            base = row + (k // 32 * 18)[None, :]
            w = _f16(base, mask) * (_nibble(base + 2, j, mask) - 8).to(tl.float32)
        elif TYPE == Q4_1:
            base = row + (k // 32 * 20)[None, :]
            w = _f16(base, mask) * _nibble(base + 4, j, mask).to(tl.float32) + _f16(base + 2, mask)
        elif TYPE == Q5_0:
            base = row + (k // 32 * 22)[None, :]
            high = (_byte(base + 2 + j // 8, mask) >> (j % 8)) & 1
            w = _f16(base, mask) * ((_nibble(base + 6, j, mask) | (high << 4)) - 16).to(tl.float32)
        else:
            base = row + (k // 32 * 34)[None, :]
            code = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = _f16(base, mask) * code.to(tl.float32)
    else:
        j = (k % 256)[None, :]
        if TYPE == Q6_K:
            base = row + (k // 256 * 210)[None, :]
            h = j // 128
            r = j % 128
            low = (_byte(base + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
            high = (_byte(base + 128 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
            sc = tl.load(base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = (_f16(base + 208, mask) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
        else:
            nbytes: tl.constexpr = 144 if TYPE == Q4_K else 176
            base = row + (k // 256 * nbytes)[None, :]
            sub = j // 32
            sc, mn = _k_scale_min(base + 4, sub, mask)
            if TYPE == Q4_K:
                code = _k_nibble(base + 16, j, mask)
            else:
                code = _k_nibble(base + 48, j, mask) | (((_byte(base + 16 + j % 32, mask) >> sub) & 1) << 4)
            w = (_f16(base, mask) * sc) * code.to(tl.float32) - _f16(base + 2, mask) * mn
    return w


@triton.jit
def gguf_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_om,
    TYPE: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = dequant_tile(w_ptr, offs_n, n_ok, k, K, stride_wn, TYPE)  # [BLOCK_N, BLOCK_K]
        for r in tl.static_range(BLOCK_M):
            # rows past M (BLOCK_M is a power of two) repeat the last one and are not stored
            x = tl.load(x_ptr + tl.minimum(r, M - 1) * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == r, acc + part[None, :], acc)
    if SPLIT_K == 1:
        store_tile(acc, out_ptr, bias_ptr, rows, offs_n, rows < M, n_ok, stride_om, HAS_BIAS)
    else:
        tl.store(part_ptr + (pid_k * BLOCK_M + rows)[:, None] * N + offs_n[None, :], acc, mask=n_ok[None, :])


@triton.jit
def gguf_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        w = dequant_tile(w_ptr, offs_n, n_ok, k, K, stride_wn, TYPE)  # [BLOCK_N, BLOCK_K]
        if IEEE:  # float32 products, no TF32 rounding
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # 16-bit tensor-core dots
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)
