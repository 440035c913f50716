"""Unified paged attention: one kernel for prefill chunks and decodes of one step.

Grid ``(num_q_blocks, num_kv_heads)``. A program owns ``BLOCK_Q`` consecutive query
tokens of one request and all ``NUM_QUERIES_PER_KV`` query heads that share one kv
head, i.e. ``BLOCK_M = BLOCK_Q * NUM_QUERIES_PER_KV`` rows of scores, so each key and
value tile is loaded once for the whole head group (GQA). It walks the request's keys
in tiles of ``TILE_N`` positions, finding each position's cache block through the block
table, and keeps a running (online) softmax.

Query blocks are numbered without a host-side table: request ``r`` owns the blocks
``query_start_loc[r] // BLOCK_Q + r`` onwards (``cdiv(q_len, BLOCK_Q)`` of them). These
ranges never overlap, so ``num_tokens // BLOCK_Q + num_reqs`` programs cover every
request; a program finds its request by binary search and exits when its block is past
the request's queries. ``DECODE`` (no request has more than one query this step) skips
both: program ``r`` is request ``r``'s, and its one query, the request's last position,
sees exactly the keys of ``[kv_begin, seq_len)``, so the tile's key mask is the causal
(and window) mask too, with no comparison a score.

Split-KV: with ``NUM_SEGMENTS > 1`` (decode batches too small to fill the GPU) a third
grid axis cuts each request's key range into segments; each program stores its
unnormalized partial result, running max and sum, and :func:`merge_segments_kernel`
combines them.

``V_SLOT_MINOR``: the value cache is slot-minor within each block
(``[num_kv_heads, head_size, block_size]`` a block, :func:`runtime_kernels.kv_cache.slot_minor`).
With tiles of whole blocks the program loads a tile's values as ``[HEAD_PAD, blocks,
BLOCK_SIZE]``, each dimension's slots of a block one run of bytes, and masks whole blocks:
the slots past ``kv_end`` in the last block (or before ``kv_begin`` in the first) are read
but weigh nothing, which needs them finite (the caches are allocated zeroed and the write
converts with saturation).

``UPCAST`` computes the dots in float32; the launcher sets it for bfloat16 under
Triton's interpreter, whose bfloat16 ``tl.dot`` is wrong (compiled kernels keep bf16).

``F16_DOTS`` (an 8-bit cache under 16-bit queries) widens keys and values to float16,
not the query's dtype: FP8 -> float16 is a single conversion instruction per pair of
values, FP8 -> bfloat16 is not (the bfloat16 route held the first FP8 decode kernel at
~2.25 TB/s). With the usual value layout the FP8 decode is bound by occupancy: Nsight Compute
on an H200 finds 8 warps an SM (255 registers and ~41 KiB of shared memory a program), busy
transposing V byte by byte (benchmarks/RESULTS.md, session 27); slot-minor values
(``V_SLOT_MINOR``) need no transposition. The
softmax scale is folded into the query first; float16 has more mantissa than bfloat16,
so the query loses nothing but values below float16's normal range. Without a softcap,
log2(e) is folded in too: the scores come out in base-2 units and the softmax takes
``exp2`` of them, one multiply a score fewer (the split-KV rows store the max back in
natural units for the merge).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request whose first query block number is <= ``q_block``."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # tanh from exp keeps the kernel free of libdevice (and runs in the interpreter).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit(do_not_specialize=["num_reqs"])  # a launch per request count would compile again
def unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], or slot-minor (V_SLOT_MINOR)
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_PAD + 2] float32 (split-KV only)
    block_table_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale,
    softcap,
    window,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    F16_DOTS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DECODE: tl.constexpr = False,
    V_SLOT_MINOR: tl.constexpr = False,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:
        req = q_block
    else:
        req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = 0 if DECODE else q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_row = local_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # query index within the request
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_row < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_offsets = (q_start + q_row)[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    # LOG2: scores in base-2 units (F16_DOTS without a softcap), so that exp2 needs no multiply a score
    LOG2: tl.constexpr = F16_DOTS and not USE_SOFTCAP
    if F16_DOTS:  # fold the scale into the query, whose magnitude then stays far inside float16's range
        q = (q.to(tl.float32) * (scale * 1.4426950408889634 if LOG2 else scale)).to(tl.float16)
        scale = 1.0

    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    q_pos = context_len + q_row  # [BLOCK_M] absolute position of each row's token
    # Keys this block may see: up to its last query, and (windowed) from its first query's window.
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table = block_table_ptr + req * stride_table
    first_tile = kv_begin // TILE_N
    end_tile = tl.cdiv(kv_end, TILE_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(end_tile - first_tile, NUM_SEGMENTS)
        first_tile = first_tile + tl.program_id(2) * per_segment
        end_tile = tl.minimum(end_tile, first_tile + per_segment)
    for tile in range(first_tile, end_tile):
        kv_pos = tile * TILE_N + offs_n  # [TILE_N]
        kv_ok = (kv_pos < kv_end) & (kv_pos >= kv_begin)
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
        k_offsets = block[None, :] * stride_k_block + slot[None, :] * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_cache_ptr + k_offsets + offs_d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        if V_SLOT_MINOR and TILE_N % BLOCK_SIZE == 0:  # whole blocks: [HEAD_PAD, blocks, slots], slots in runs
            TILE_BLOCKS: tl.constexpr = TILE_N // BLOCK_SIZE
            tile_block = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
            block_ok = (tile_block * BLOCK_SIZE < kv_end) & ((tile_block + 1) * BLOCK_SIZE > kv_begin)
            v_block = tl.load(table + tile_block, mask=block_ok, other=0).to(tl.int64)
            v_ptrs = (v_cache_ptr + kv_head * stride_v_head + v_block[None, :, None] * stride_v_block
                      + offs_d[:, None, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, None, :])
            if HEAD_PAD == HEAD_SIZE:
                v_t = tl.load(v_ptrs, mask=block_ok[None, :, None], other=0.0)
            else:
                v_t = tl.load(v_ptrs, mask=block_ok[None, :, None] & d_ok[:, None, None], other=0.0)
            v = tl.trans(tl.reshape(v_t, (HEAD_PAD, TILE_N)))
        else:
            v_offsets = block[:, None] * stride_v_block + slot[:, None] * stride_v_slot + kv_head * stride_v_head
            v_dims = offs_d * BLOCK_SIZE if V_SLOT_MINOR else offs_d
            v = tl.load(v_cache_ptr + v_offsets + v_dims[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        # The query's dtype: float32 under UPCAST; float16 from an FP8 cache under F16_DOTS
        # (one hardware instruction per two values, where bf16 takes a detour through float32).
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N] float32
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if DECODE:  # kv_ok is the one query's causal and window mask
            s = tl.where(kv_ok[None, :], s, float("-inf"))
        else:
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            if USE_WINDOW:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        if LOG2:
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        else:
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (q_start + q_row)[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Row layout of the scratch: HEAD_PAD accumulator values, then the max, then the sum.
        num_heads = tl.num_programs(1) * NUM_QUERIES_PER_KV
        row = ((q_start + q_row).to(tl.int64) * num_heads + head) * NUM_SEGMENTS + tl.program_id(2)
        base = partial_ptr + row * (HEAD_PAD + 2)
        tl.store(base[:, None] + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(base + HEAD_PAD, m_i * 0.6931471805599453 if LOG2 else m_i, mask=row_ok)  # the merge's natural units
        tl.store(base + HEAD_PAD + 1, l_i, mask=row_ok)


@triton.jit
def merge_segments_kernel(
    partial_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_PAD + 2] float32
    out_ptr,  # [num_tokens, num_heads, head_size]
    stride_o_tok,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = partial_ptr + ((token * tl.num_programs(1) + head) * NUM_SEGMENTS + segs) * (HEAD_PAD + 2)
    m = tl.load(base + HEAD_PAD)  # [NUM_SEGMENTS]; -inf for segments that saw no key
    l = tl.load(base + HEAD_PAD + 1)
    acc = tl.load(base[:, None] + offs_d[None, :])  # [NUM_SEGMENTS, HEAD_PAD]
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    o_ptr = out_ptr + token * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)
