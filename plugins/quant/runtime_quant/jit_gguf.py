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
allows: 16 bytes for Q4_1 / Q4_K / Q5_K, 2 for the others) and each scale field once per run.
A code is moved to the top of a float's mantissa (a shift and a mask: ``1 + code / 2**bits``)
and turned into its weight by one fused multiply-add (:func:`_weights`); the GEMM's weights
are gguf-py's bit for bit.

- :func:`gguf_gemv_kernel` (decode, up to 4 rows of ``x``, all in one program so the weights are
  read once): products summed per weight position across the program's K steps, in float32,
  reduced once at the end; split along K, the last split of a column block adds the partial
  sums (``jit_wna16.store_split_k``);
- :func:`gguf_gemm_kernel` (prefill): per K step the two pieces are joined into one
  [BLOCK_N, BLOCK_K] tile of consecutive inputs (:func:`_tile`, rounded to the activations' 16-bit
  dtype), dotted once (tensor cores) with the contiguous [BLOCK_M, BLOCK_K] ``x`` tile; a single row
  block may be split along K (``store_split_k``, as the GEMV). The tile lives in registers (a few registers a
  weight), which bounds the tile sizes (see ``gguf_gpu.gemm_config``);
- :func:`gguf_dequantize_kernel`: the same tiles stored as a dense [N, K] matrix (the large-batch
  path: one layer's scratch, then cuBLAS).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_quant.jit_gemm import store_tile
from runtime_quant.jit_wna16 import store_split_k

Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def _bits_at(bits, SHIFT: tl.constexpr, WIDTH: tl.constexpr, AT: tl.constexpr):
    """Bits ``SHIFT .. SHIFT + WIDTH`` of the int32 ``bits`` moved to bits ``AT .. AT + WIDTH`` (the rest 0)."""
    if AT >= SHIFT:
        moved = bits << (AT - SHIFT)
    else:
        moved = bits >> (SHIFT - AT)
    return moved & (((1 << WIDTH) - 1) << AT)


@triton.jit
def _weights(mantissa, scale, offset, BITS: tl.constexpr, ZERO: tl.constexpr, EXACT: tl.constexpr):
    """gguf-py's weights ``scale * (code - ZERO) + offset`` from a ``BITS``-bit code placed at the top of
    a float's mantissa (``mantissa`` [BLOCK_N, A, I]: the float is ``v = 1 + code / 2**BITS``); ``scale``
    and ``offset`` per run [BLOCK_N, A]. A fused multiply-add ``v * scale 2**BITS - scale (2**BITS + ZERO)``
    gives ``scale * (code - ZERO)`` rounded once, as gguf-py (the constant is exact: a float16 times a
    few bits); ``EXACT`` then adds the offset as gguf-py does, else it is folded into the constant (one
    instruction less, a rounding of the constant: ~1e-7 of the weights)."""
    v = (mantissa | 0x3F800000).to(tl.float32, bitcast=True)
    a = (scale * (1 << BITS))[:, :, None].broadcast_to(v.shape)
    if EXACT:
        c = (-(scale * ((1 << BITS) + ZERO)))[:, :, None].broadcast_to(v.shape)
        return tl.fma(v, a, c) + offset[:, :, None]
    c = (offset - scale * ((1 << BITS) + ZERO))[:, :, None].broadcast_to(v.shape)
    return tl.fma(v, a, c)


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
def _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE: tl.constexpr, A: tl.constexpr,
            EXACT: tl.constexpr):
    """Units ``u0 .. u0 + A`` of rows at byte offsets ``rows_b`` [BLOCK_N] as two pieces ``(w, kk)``:
    weights [BLOCK_N, A, I] and their inputs [A, I] (see the module docstring; 0 past the row);
    ``EXACT``: gguf-py's values bit for bit, also for the types with an offset (see :func:`_weights`)."""
    u = u0 + tl.arange(0, A)
    ok = n_ok[:, None] & (u < num_units)[None, :]  # [BLOCK_N, A]
    if TYPE == Q4_0 or TYPE == Q4_1 or TYPE == Q5_0 or TYPE == Q8_0:  # unit = block of 32
        NBYTES: tl.constexpr = 18 if TYPE == Q4_0 else (20 if TYPE == Q4_1 else (22 if TYPE == Q5_0 else 34))
        i = tl.arange(0, 16)
        block = rows_b[:, None] + (u * NBYTES)[None, :]  # [BLOCK_N, A] byte offset
        d = _f16(w16_ptr, block // 2, ok)
        kk = u[:, None] * 32 + i[None, :]
        if TYPE == Q8_0:  # int8 codes: code - 128 stored
            w0 = _weights(_bits_at(_run_bytes(w_ptr, block + 2, i, ok) ^ 128, 0, 8, 15), d, 0.0, 8, 128, False)
            w1 = _weights(_bits_at(_run_bytes(w_ptr, block + 18, i, ok) ^ 128, 0, 8, 15), d, 0.0, 8, 128, False)
        elif TYPE == Q5_0:
            qs = _run_bytes(w_ptr, block + 6, i, ok)  # byte i: inputs i (low nibble), i + 16 (high)
            qh = (tl.load(w16_ptr + block // 2 + 1, mask=ok, other=0).to(tl.int32) & 0xFFFF) | (
                tl.load(w16_ptr + block // 2 + 2, mask=ok, other=0).to(tl.int32) << 16)  # bit j: input j
            qh = qh[:, :, None] >> i[None, None, :]  # bits i and i + 16 at 0 and 16
            w0 = _weights(_bits_at(qs, 0, 4, 18) | _bits_at(qh, 0, 1, 22), d, 0.0, 5, 16, False)
            w1 = _weights(_bits_at(qs, 4, 4, 18) | _bits_at(qh, 16, 1, 22), d, 0.0, 5, 16, False)
        else:
            qs = _run_bytes(w_ptr, block + (NBYTES - 16), i, ok)
            ZERO: tl.constexpr = 8 if TYPE == Q4_0 else 0
            m = _f16(w16_ptr, block // 2 + 1, ok) if TYPE == Q4_1 else 0.0
            w0 = _weights(_bits_at(qs, 0, 4, 19), d, m, 4, ZERO, EXACT and TYPE == Q4_1)
            w1 = _weights(_bits_at(qs, 4, 4, 19), d, m, 4, ZERO, EXACT and TYPE == Q4_1)
        return w0, kk, w1, kk + 16
    elif TYPE == Q4_K or TYPE == Q5_K:  # unit = 64-input chunk c of a super-block: byte l at inputs l, l + 32
        NBYTES: tl.constexpr = 144 if TYPE == Q4_K else 176
        i = tl.arange(0, 32)
        c = u % 4
        block = rows_b[:, None] + (u // 4 * NBYTES)[None, :]
        qs = _run_bytes(w_ptr, block + (NBYTES - 128) + (c * 32)[None, :], i, ok)
        d = _f16(w16_ptr, block // 2, ok)
        dmin = _f16(w16_ptr, block // 2 + 1, ok)
        sc0, mn0 = _k_scale_min(w_ptr + block + 4, (2 * c)[None, :], ok)
        sc1, mn1 = _k_scale_min(w_ptr + block + 4, (2 * c + 1)[None, :], ok)
        kk = (u // 4 * 256 + c * 64)[:, None] + i[None, :]
        if TYPE == Q4_K:
            w0 = _weights(_bits_at(qs, 0, 4, 19), d * sc0, -(dmin * mn0), 4, 0, EXACT)
            w1 = _weights(_bits_at(qs, 4, 4, 19), d * sc1, -(dmin * mn1), 4, 0, EXACT)
        else:  # bit s of qh byte l: input 32 s + l
            qh = _run_bytes(w_ptr, block + 16, i, ok) >> (2 * c)[None, :, None]
            w0 = _weights(_bits_at(qs, 0, 4, 18) | _bits_at(qh, 0, 1, 22), d * sc0, -(dmin * mn0), 5, 0, EXACT)
            w1 = _weights(_bits_at(qs, 4, 4, 18) | _bits_at(qh, 1, 1, 22), d * sc1, -(dmin * mn1), 5, 0, EXACT)
        return w0, kk, w1, kk + 32
    else:  # Q6_K, unit (h, g, e): ql bytes 64 h + 32 g + 16 e + i, qh bytes 128 + 32 h + 16 e + i
        i = tl.arange(0, 16)
        h = (u // 4) % 2
        g = (u // 2) % 2
        e = u % 2
        block = rows_b[:, None] + (u // 8 * 210)[None, :]
        ql = _run_bytes(w_ptr, block + (64 * h + 32 * g + 16 * e)[None, :], i, ok)
        qh = _run_bytes(w_ptr, block + (128 + 32 * h + 16 * e)[None, :], i, ok) >> (2 * g)[None, :, None]
        d = _f16(w16_ptr, block // 2 + 104, ok)
        sub = (8 * h + 2 * g + e)[None, :]  # sub-blocks of 16 inputs
        sc0 = tl.load(w_ptr + block + 192 + sub, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc1 = tl.load(w_ptr + block + 196 + sub, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        kk = (u // 8 * 256 + h * 128 + g * 32 + e * 16)[:, None] + i[None, :]
        # inputs 128 h + 32 g + 16 e + i: low nibbles and bit pair 2 g; those + 64: high nibbles, pair 2 g + 4
        w0 = _weights(_bits_at(ql, 0, 4, 17) | _bits_at(qh, 0, 2, 21), d * sc0, 0.0, 6, 32, False)
        w1 = _weights(_bits_at(ql, 4, 4, 17) | _bits_at(qh, 4, 2, 21), d * sc1, 0.0, 6, 32, False)
        return w0, kk, w1, kk + 64


@triton.jit
def _add_row(acc, w0, k0, w1, k1, x_ptr, r: tl.constexpr, stride_xm, M, K):
    """``acc`` [BLOCK_N, A, I] plus both pieces' weights times row ``r`` of ``x`` at their inputs (rows
    past M repeat the last one: they are not stored)."""
    x_row = x_ptr + tl.minimum(r, M - 1) * stride_xm
    x0 = tl.load(x_row + k0, mask=k0 < K, other=0.0).to(tl.float32)[None, :, :].broadcast_to(w0.shape)  # [A, I]
    x1 = tl.load(x_row + k1, mask=k1 < K, other=0.0).to(tl.float32)[None, :, :].broadcast_to(w1.shape)
    return tl.fma(w1, x1, tl.fma(w0, x0, acc))


@triton.jit
def _row_sums(acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr):
    """The per-position sums of rows 0..BLOCK_M-1 reduced: [BLOCK_M, BLOCK_N]."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    out = tl.where(rows == 0, tl.sum(tl.sum(acc0, axis=2), axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        out = tl.where(rows == 1, tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :], out)
    if BLOCK_M > 2:
        out = tl.where(rows == 2, tl.sum(tl.sum(acc2, axis=2), axis=1)[None, :], out)
        out = tl.where(rows == 3, tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :], out)
    return out


@triton.jit
def _tile(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE: tl.constexpr, A: tl.constexpr, DTYPE: tl.constexpr):
    """Units ``u0 .. u0 + A`` as one weight tile [BLOCK_N, BLOCK_K] (gguf-py's values, rounded to ``DTYPE``) whose
    columns are the consecutive inputs ``u0 * unit .. + BLOCK_K``: both pieces joined and their runs put
    in input order (Q6_K: ``u0`` and ``A`` multiples of 4, a whole 128-input half of a super-block per 4 units)."""
    w0, k0, w1, k1 = _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A, True)
    BLOCK_N: tl.constexpr = w0.shape[0]
    I: tl.constexpr = w0.shape[2]
    w = tl.join(w0.to(DTYPE), w1.to(DTYPE))  # [BLOCK_N, A, I, 2]: the second piece's inputs follow the first's in each run
    if TYPE == Q6_K:  # units (g, e) of a half at 16 (2 g + e), pieces at 0 and 64
        w = tl.permute(tl.reshape(w, (BLOCK_N, A // 4, 4, I, 2)), (0, 1, 4, 2, 3))
    else:  # Q*_0: I = 16 inputs a piece, pieces at 0 and 16; K-quants: 32, at 0 and 32
        w = tl.permute(w, (0, 1, 3, 2))
    return tl.reshape(w, (BLOCK_N, A * 2 * I))


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
    num_units = K // (64 if TYPE == Q4_K or TYPE == Q5_K else 32)
    # products summed per weight position across the K steps, in the weights' layout (one
    # accumulator per row of x, BLOCK_M <= 4): one reduction at the end
    acc0 = tl.zeros([BLOCK_N, A, I], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    start = tl.program_id(1) * UNITS_PER_SPLIT
    for u0 in range(start, tl.minimum(start + UNITS_PER_SPLIT, num_units), A):
        w0, k0, w1, k1 = _pieces(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A, False)
        acc0 = _add_row(acc0, w0, k0, w1, k1, x_ptr, 0, stride_xm, M, K)
        if BLOCK_M > 1:
            acc1 = _add_row(acc1, w0, k0, w1, k1, x_ptr, 1, stride_xm, M, K)
        if BLOCK_M > 2:
            acc2 = _add_row(acc2, w0, k0, w1, k1, x_ptr, 2, stride_xm, M, K)
            acc3 = _add_row(acc3, w0, k0, w1, k1, x_ptr, 3, stride_xm, M, K)
    store_split_k(_row_sums(acc0, acc1, acc2, acc3, BLOCK_M), out_ptr, bias_ptr, part_ptr, lock_ptr, rows, offs_n,
                  rows < M, n_ok, N, stride_om, SPLIT_K, HAS_BIAS)


@triton.jit(do_not_specialize=["UNITS_PER_SPLIT", "SPLIT_K"])
def gguf_gemm_kernel(
    x_ptr, w_ptr, w16_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, UNITS_PER_SPLIT, SPLIT_K,
    stride_xm, stride_wn, stride_om,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A: tl.constexpr,  # units per K step: BLOCK_K / unit inputs
):
    """Program (column block, split, row block): per K step the [BLOCK_N, BLOCK_K] weight tile
    dequantized once (:func:`_tile`) and one ``tl.dot`` with the contiguous [BLOCK_M, BLOCK_K] ``x`` tile;
    splits (only with one row block: its rows are ``0 .. BLOCK_M``) end as the GEMV's (``store_split_k``)."""
    UNIT: tl.constexpr = 64 if TYPE == Q4_K or TYPE == Q5_K else 32
    BLOCK_K: tl.constexpr = A * UNIT
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    rows_b = offs_n.to(tl.int64) * stride_wn
    num_units = K // UNIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = tl.program_id(1) * UNITS_PER_SPLIT
    for u0 in range(start, tl.minimum(start + UNITS_PER_SPLIT, num_units), A):
        k = u0 * UNIT + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:  # float32 products, no TF32 rounding
            w = _tile(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A, tl.float32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # 16-bit tensor-core dots (the tile held in 16 bits: half the registers)
            w = _tile(w_ptr, w16_ptr, rows_b, n_ok, u0, num_units, TYPE, A, x_ptr.dtype.element_ty)
            acc += tl.dot(x, tl.trans(w))
    store_split_k(acc, out_ptr, bias_ptr, part_ptr, lock_ptr, offs_m, offs_n, m_ok, n_ok, N, stride_om, SPLIT_K, HAS_BIAS)


@triton.jit
def gguf_dequantize_kernel(
    w_ptr, w16_ptr, out_ptr, N, K, stride_wn, stride_on,
    TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A: tl.constexpr,
):
    """Program (column block, K step): the weight tile [BLOCK_N, BLOCK_K] (gguf-py's values) into
    ``out`` [N, K] in its dtype (the large-batch path: a one-layer scratch, then cuBLAS)."""
    UNIT: tl.constexpr = 64 if TYPE == Q4_K or TYPE == Q5_K else 32
    BLOCK_K: tl.constexpr = A * UNIT
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    u0 = tl.program_id(1) * A
    w = _tile(w_ptr, w16_ptr, offs_n.to(tl.int64) * stride_wn, n_ok, u0, K // UNIT, TYPE, A, out_ptr.dtype.element_ty)
    k = u0 * UNIT + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + k[None, :], w,
             mask=n_ok[:, None] & (k < K)[None, :])
