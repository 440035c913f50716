"""Structured output: disallowed tokens of a packed bitmask set to -inf in the logits, in place."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def apply_token_bitmask_kernel(
    logits_ptr,  # [num_logits_rows, vocab_size] float, written in place
    bitmask_ptr,  # [num_rows, num_words] int32 (a table with HAS_SLOTS): bit t % 32 of word t // 32 set = token t allowed
    rows_ptr,  # [num_rows] int64: the logits row of each bitmask row (unused without HAS_ROWS)
    slots_ptr,  # [num_rows] int32: the table row of each masked row, < 0 for none (unused without HAS_SLOTS)
    vocab_size,
    num_words,
    stride_logits,
    stride_bitmask,
    HAS_ROWS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    word = tokens // 32
    source = i.to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + i)
        in_vocab = in_vocab & ((tokens * 0 + slot) >= 0)  # no slot: the row is not masked
        source = tl.maximum(slot, 0).to(tl.int64)
    # Tokens past the bitmask's width read a zero word: not allowed.
    words = tl.load(bitmask_ptr + source * stride_bitmask + word, mask=in_vocab & (word < num_words), other=0)
    allowed = (words >> (tokens % 32)) & 1
    row = i.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & (allowed == 0))
