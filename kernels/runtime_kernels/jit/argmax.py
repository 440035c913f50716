"""Each row's argmax in two passes: chunks of the row in parallel, then the row's chunks."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_max(values, indices, BIG: tl.constexpr):
    """(value, index) of the first largest of ``values``, a NaN counting as the largest (as torch's argmax
    counts it); ``indices`` ascend along the block."""
    nan = values != values
    has_nan = tl.max(nan.to(tl.int32), axis=0)
    first_nan = tl.min(tl.where(nan, indices, BIG), axis=0)
    best, at = tl.max(tl.where(nan, float("-inf"), values), axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.sum(tl.where(tl.arange(0, values.shape[0]) == at, indices, 0), axis=0)
    return tl.where(has_nan > 0, float("nan"), best), tl.where(has_nan > 0, first_nan, index)


@triton.jit
def argmax_chunks_kernel(
    logits_ptr,  # [N, V] float
    values_ptr,  # [N, NUM_CHUNKS] float32, written
    indices_ptr,  # [N, NUM_CHUNKS] int64, written
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    value, index = first_max(x, cols.to(tl.int64), 1 << 62)
    tl.store(values_ptr + row * NUM_CHUNKS + chunk, value)
    tl.store(indices_ptr + row * NUM_CHUNKS + chunk, index)


@triton.jit
def argmax_rows_kernel(
    values_ptr,  # [N, NUM_CHUNKS] float32
    indices_ptr,  # [N, NUM_CHUNKS] int64
    out_ptr,  # [N] int64, written
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < NUM_CHUNKS
    values = tl.load(values_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=float("-inf"))
    indices = tl.load(indices_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=1 << 62)
    # chunks hold ascending stretches of the row, so the first chunk with the largest value holds the first maximum
    _, index = first_max(values, indices, 1 << 62)
    tl.store(out_ptr + row, index)
