"""Triton kernels over llama.cpp's quantized blocks, dequantized in the kernel: ``out = x @ W.T``.

The weights are the layer's raw rows as stored (no repack, no dequantized copy: memory stays at
the GGUF bit rate): uint8 [N, row bytes] (:mod:`runtime_quant.gguf_blocks` has the seven
layouts), passed twice, as bytes (``w_ptr``) and as 16-bit words (``w16_ptr``, the same memory:
every block has an even size, so its float16 fields are whole words).

A K step covers ``A`` *units* of whole runs of code bytes: a Q*_0 block (32 inputs), a K-quant's
64-input chunk (Q4_K, Q5_K: 32 bytes of nibbles) or a quarter of a Q6_K half (32 inputs: 16
bytes of low nibbles and 16 of high bit pairs). :func:`_pieces` reads a step as two *pieces*,
the low and the high nibbles (Q8_0: the two halves) of each run: weights [BLOCK_N, A, I] and the
inputs ``kk`` [A, I] they multiply, each run contiguous in K and inside one sub-block. Code
bytes are loaded as runs of consecutive bytes per row (vector loads where the block's alignment
allows: 16 bytes for Q4_1 / Q4_K / Q5_K, 2 for the others) and each scale field once per run; a
code costs a shift or mask, an OR and a subtraction (:func:`_as_float`), then
``scale * q + offset`` in gguf-py's order of operations (a compiler may fuse the multiply-add).

- :func:`gguf_gemv_kernel` (decode, up to 4 rows of ``x``, all in one program so the weights are
  read once): products summed per weight position across the program's K steps, in float32,
  reduced once at the end; split along K, the last split of a column block adds the partial
  sums (``jit_wna16.store_split_k``);
- :func:`gguf_gemm_kernel` (prefill): each piece feeds ``tl.dot`` (16-bit tensor cores) against
  the matching [BLOCK_M, A * I] columns of ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_quant.jit_gemm import store_tile, tile_offsets
from runtime_quant.jit_wna16 import store_split_k

Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def _as_float(code, ZERO: tl.constexpr):
    """``code - ZERO`` as float32, exactly, for int32 codes in [0, 2**23): the code as a float's
    mantissa (2**23 + code), less 2**23 + ZERO (an OR and a subtraction, no int-to-float convert)."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZERO)


@triton.jit
def _f16(w16_ptr, word, mask):
    """The float16 at 16-bit word ``word`` of the rows, as float32."""
    return tl.load(w16_ptr + word, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _run_bytes(w_ptr, start, i, mask):
    """Bytes ``start + i`` ([BLOCK_N, A] + [I]) as int32 [BLOCK_N, A, I] (0 where masked)."""
    return tl.load(w_ptr + start[:, :, None] + i[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)


@triton.jit
def _k_scale_min(s_ptr, j, mask):
    """6-bit scale and min of sub-blocks ``j`` [1, A] (0..7) of a K-quant's 12 scale bytes at ``s_ptr``."""
    a = tl.load(s_ptr + j % 4, mask=mask, other=0).to(tl.int32)
    b = tl.load(s_ptr + j % 4 + 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(s_ptr + j % 4 + 8, mask=mask, other=0).to(tl.int32)
    low = j < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _scaled(q, scale, offset, HAS_OFFSET: tl.constexpr):
    """gguf-py's weights ``scale * q (+ offset)``: codes [BLOCK_N, A, I], scale and offset per run [BLOCK_N, A]."""
    w = scale[:, :, None] * q
    if HAS_OFFSET:
        w = w + offset[:, :, None]
    return w


@triton.jit
def _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE: tl.constexpr, A: tl.constexpr):
    """Units ``u0 .. u0 + A`` of rows at byte offsets ``rows_b`` [BLOCK_N] as two pieces ``(w, kk)``:
    weights [BLOCK_N, A, I] and their inputs [A, I] (see the module docstring; 0 past the row)."""
    u = u0 + tl.arange(0, A)
    ok = n_ok[:, None] & (u < num_units)[None, :]  # [BLOCK_N, A]
    if TYPE == Q4_0 or TYPE == Q4_1 or TYPE == Q5_0 or TYPE == Q8_0:  # unit = block of 32
        NBYTES: tl.constexpr = 18 if TYPE == Q4_0 else (20 if TYPE == Q4_1 else (22 if TYPE == Q5_0 else 34))
        i = tl.arange(0, 16)
        block = rows_b[:, None] + (u * NBYTES)[None, :]  # [BLOCK_N, A] byte offset
        d = _f16(w16_ptr, block // 2, ok)
        kk = u[:, None] * 32 + i[None, :]
        if TYPE == Q8_0:
            q0 = _as_float(_run_bytes(w_ptr, block + 2, i, ok) ^ 128, 128)  # int8 + 128
            q1 = _as_float(_run_bytes(w_ptr, block + 18, i, ok) ^ 128, 128)
        elif TYPE == Q5_0:
            qs = _run_bytes(w_ptr, block + 6, i, ok)  # byte i: inputs i (low nibble), i + 16 (high)
            qh = (tl.load(w16_ptr + block // 2 + 1, mask=ok, other=0).to(tl.int32) & 0xFFFF) | (
                tl.load(w16_ptr + block // 2 + 2, mask=ok, other=0).to(tl.int32) << 16)  # bit j: input j
            q0 = _as_float((qs & 15) | (((qh[:, :, None] >> i[None, None, :]) & 1) << 4), 16)
            q1 = _as_float((qs >> 4) | (((qh[:, :, None] >> (i + 16)[None, None, :]) & 1) << 4), 16)
        else:
            qs = _run_bytes(w_ptr, block + (NBYTES - 16), i, ok)
            ZERO: tl.constexpr = 8 if TYPE == Q4_0 else 0
            q0 = _as_float(qs & 15, ZERO)
            q1 = _as_float(qs >> 4, ZERO)
        m = _f16(w16_ptr, block // 2 + 1, ok) if TYPE == Q4_1 else d
        return _scaled(q0, d, m, TYPE == Q4_1), kk, _scaled(q1, d, m, TYPE == Q4_1), kk + 16
    elif TYPE == Q4_K or TYPE == Q5_K:  # unit = 64-input chunk c of a super-block: byte l at inputs l, l + 32
        NBYTES: tl.constexpr = 144 if TYPE == Q4_K else 176
        i = tl.arange(0, 32)
        c = u % 4
        block = rows_b[:, None] + (u // 4 * NBYTES)[None, :]
        qs = _run_bytes(w_ptr, block + (NBYTES - 128) + (c * 32)[None, :], i, ok)
        lo = qs & 15
        hi = qs >> 4
        if TYPE == Q5_K:  # bit s of byte l: input 32 s + l
            qh = _run_bytes(w_ptr, block + 16, i, ok) >> (2 * c)[None, :, None]
            lo = lo | ((qh & 1) << 4)
            hi = hi | ((qh & 2) << 3)
        d = _f16(w16_ptr, block // 2, ok)
        dmin = _f16(w16_ptr, block // 2 + 1, ok)
        sc0, mn0 = _k_scale_min(w_ptr + block + 4, (2 * c)[None, :], ok)
        sc1, mn1 = _k_scale_min(w_ptr + block + 4, (2 * c + 1)[None, :], ok)
        kk = (u // 4 * 256 + c * 64)[:, None] + i[None, :]
        return (_scaled(_as_float(lo, 0), d * sc0, -(dmin * mn0), True), kk,
                _scaled(_as_float(hi, 0), d * sc1, -(dmin * mn1), True), kk + 32)
    else:  # Q6_K, unit (h, g, e): ql bytes 64 h + 32 g + 16 e + i, qh bytes 128 + 32 h + 16 e + i
        i = tl.arange(0, 16)
        h = (u // 4) % 2
        g = (u // 2) % 2
        e = u % 2
        block = rows_b[:, None] + (u // 8 * 210)[None, :]
        ql = _run_bytes(w_ptr, block + (64 * h + 32 * g + 16 * e)[None, :], i, ok)
        qh = _run_bytes(w_ptr, block + (128 + 32 * h + 16 * e)[None, :], i, ok) >> (2 * g)[None, :, None]
        q0 = _as_float((ql & 15) | ((qh & 3) << 4), 32)  # inputs 128 h + 32 g + 16 e + i
        q1 = _as_float((ql >> 4) | (qh & 48), 32)  # those + 64: bit pair 2 g + 4
        d = _f16(w16_ptr, block // 2 + 104, ok)
        sub = (8 * h + 2 * g + e)[None, :]  # sub-blocks of 16 inputs
        sc0 = tl.load(w_ptr + block + 192 + sub, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc1 = tl.load(w_ptr + block + 196 + sub, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        kk = (u // 8 * 256 + h * 128 + g * 32 + e * 16)[:, None] + i[None, :]
        return _scaled(q0, d * sc0, d, False), kk, _scaled(q1, d * sc1, d, False), kk + 64


@triton.jit
def _x_runs(x_rows, kk, K):
    """``x`` at inputs ``kk`` [A, I] of the rows at ``x_rows`` [BLOCK_M, 1, 1]: [BLOCK_M, A, I] float32."""
    return tl.load(x_rows + kk[None, :, :], mask=(kk < K)[None, :, :], other=0.0).to(tl.float32)


@triton.jit
def _gemm_piece(acc, w, kk, x_rows, m_ok, K, IEEE: tl.constexpr):
    """``acc`` [BLOCK_M, BLOCK_N] plus the ``x`` rows at ``x_rows`` [BLOCK_M, 1] times weights ``w`` of inputs ``kk``."""
    w = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))  # [BLOCK_N, A * I]
    k = tl.reshape(kk, (kk.shape[0] * kk.shape[1],))
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    if IEEE:  # float32 products, no TF32 rounding
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))  # 16-bit tensor-core dots


@triton.jit(do_not_specialize=["UNITS_PER_SPLIT", "SPLIT_K"])  # one compiled kernel for every split
def gguf_gemv_kernel(
    x_ptr, w_ptr, w16_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, UNITS_PER_SPLIT, SPLIT_K,
    stride_xm, stride_wn, stride_om,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A: tl.constexpr,  # units per K step
):
    I: tl.constexpr = 32 if TYPE == Q4_K or TYPE == Q5_K else 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_b = offs_n.to(tl.int64) * stride_wn
    rows = tl.arange(0, BLOCK_M)
    # rows past M (BLOCK_M is a power of two) repeat the last one and are not stored
    x_rows = x_ptr + tl.minimum(rows, M - 1)[:, None, None] * stride_xm
    num_units = K // (64 if TYPE == Q4_K or TYPE == Q5_K else 32)
    # products summed per weight position, across the K steps: one reduction at the end
    acc = tl.zeros([BLOCK_M, BLOCK_N, A, I], dtype=tl.float32)
    start = tl.program_id(1) * UNITS_PER_SPLIT
    for u0 in range(start, tl.minimum(start + UNITS_PER_SPLIT, num_units), A):
        w0, k0, w1, k1 = _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A)
        acc += w0[None, :, :, :] * _x_runs(x_rows, k0, K)[:, None, :, :]
        acc += w1[None, :, :, :] * _x_runs(x_rows, k1, K)[:, None, :, :]
    store_split_k(tl.sum(tl.sum(acc, axis=3), axis=2), out_ptr, bias_ptr, part_ptr, lock_ptr, rows, offs_n,
                  rows < M, n_ok, N, stride_om, SPLIT_K, HAS_BIAS)


@triton.jit
def gguf_gemm_kernel(
    x_ptr, w_ptr, w16_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A: tl.constexpr,  # units per K step: BLOCK_K / unit inputs
):
    offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    rows_b = offs_n.to(tl.int64) * stride_wn
    num_units = K // (64 if TYPE == Q4_K or TYPE == Q5_K else 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for u0 in range(0, num_units, A):
        w0, k0, w1, k1 = _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A)
        acc = _gemm_piece(acc, w0, k0, x_rows, m_ok, K, IEEE)
        acc = _gemm_piece(acc, w1, k1, x_rows, m_ok, K, IEEE)
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS)
