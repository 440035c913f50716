"""unified_attention (Triton) against unified_attention_ref (plain torch) on mixed batches.

Batches mix prefills with and without cached context, chunks longer than one query
block and decodes, over shuffled block tables, with GQA, sliding windows and
soft-capping. The reference is itself checked against a per-token loop.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from runtime_kernels.attention import (  # noqa: E402
    attention_tiles,
    num_kv_segments,
    unified_attention,
    unified_attention_ref,
)

from runtime_kernels.kv_cache import slot_minor  # noqa: E402
from support.kernel_testing import BF16_TOL

# (tokens already cached, new tokens this step) per request.
MIXED = [(0, 9), (7, 1), (0, 1), (13, 1), (4, 6), (11, 19), (2, 1), (30, 1)]


def make_batch(requests, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in requests]
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    q_lens = [q for _, q in requests]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), num_heads, head_size, generator=gen)
    to = dict(device=device)
    return (query.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), qsl.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(**to), max(q_lens))


def run_both(batch, scale, window=None, softcap=None, num_segments=None):
    query, kv, qsl, seq_lens, table, max_q = batch
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kv[0], kv[1], out, qsl, seq_lens, table, max_q, scale, window, softcap,
                      num_segments=num_segments)
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, scale, window, softcap)
    return out, ref


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_size, block_size, window, softcap",
    [
        (4, 2, 64, 16, None, None),  # GQA, plain causal
        (4, 4, 128, 8, 5, None),  # MHA, sliding window shorter than a block
        (6, 2, 256, 16, 12, 30.0),  # group of 3 (not a power of two), window + soft-cap
        (7, 1, 64, 4, None, 5.0),  # MQA with a 7-head group, small blocks
    ],
)
def test_matches_reference_on_mixed_batch(device, num_heads, num_kv_heads, head_size, block_size, window, softcap):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, torch.float32, device)
    out, ref = run_both(batch, head_size**-0.5, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_only_batch_uses_small_tiles(device):
    requests = [(c, 1) for c in (0, 5, 16, 33, 1)]
    assert attention_tiles(1, 2, 64).block_m == 16
    batch = make_batch(requests, 4, 2, 64, 16, torch.float32, device, seed=1)
    out, ref = run_both(batch, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "window, softcap, num_segments",
    [(None, None, 1), (5, None, 1), (3, 20.0, 2), (40, None, 4), (150, None, 1), (100, None, 2)],
    ids=["causal", "window-5", "window-3-softcap-split", "window-40-split", "window-150", "window-100-split"],
)
def test_decode_batch_one_program_per_request(device, window, softcap, num_segments):
    """max_query_len 1 launches a program per request, whose tile key mask is the causal (and window) mask of its
    one query; a request with no query this step (as a padded graph row) writes nothing. 128 and 320 keys end on
    a 64-key tile's edge, and a long window starts inside a tile with whole tiles after it."""
    requests = [(0, 1), (9, 1), (10, 0), (31, 1), (64, 1), (2, 1), (127, 1), (300, 1), (319, 1)]
    batch = make_batch(requests, 4, 2, 64, 16, torch.float32, device, seed=8)
    out, ref = run_both(batch, 0.125, window, softcap, num_segments=num_segments)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "requests, num_segments, window, softcap",
    [
        ([(0, 1), (40, 1), (130, 1)], 4, None, None),  # decodes, some segments see no key
        ([(0, 9), (7, 1), (30, 3)], 2, 7, 10.0),  # the split path also serves prefill chunks
    ],
)
def test_split_kv_segments(device, requests, num_segments, window, softcap):
    batch = make_batch(requests, 4, 2, 64, 16, torch.float32, device, seed=4)
    out, ref = run_both(batch, 0.125, window, softcap, num_segments=num_segments)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_segments_only_for_small_batches_of_few_queries():
    assert num_kv_segments(1, 4096, 2, 8, 64, torch.device("cpu")) == 16  # 16 programs, long context
    assert num_kv_segments(1, 300, 2, 8, 64, torch.device("cpu")) == 1  # too short to split
    assert num_kv_segments(1, 4096, 256, 8, 64, torch.device("cpu")) == 1  # the GPU is full already
    assert num_kv_segments(5, 4096, 2, 8, 64, torch.device("cpu")) == 1  # prefill present
    # Speculative verification: 1 + 4 queries per request fit one program's 8 query rows.
    assert num_kv_segments(5, 4096, 2, 8, 64, torch.device("cpu"), block_q=8) == 16
    assert num_kv_segments(9, 4096, 2, 8, 64, torch.device("cpu"), block_q=8) == 1  # two programs per request


def test_verification_batch_splits_its_keys(device):
    """Up to 1 + 4 queries per request (some with fewer drafts) over long contexts: 32-row tiles,
    split-KV chosen on its own, and the same attention as the reference."""
    tiles = attention_tiles(5, 4, 64)
    assert (tiles.block_m, tiles.block_q) == (32, 8)
    requests = [(300, 5), (41, 2), (700, 5), (9, 1)]
    batch = make_batch(requests, 16, 4, 64, 16, torch.float32, device, seed=6)
    query, kv, qsl, seq_lens, table, max_q = batch
    assert num_kv_segments(max_q, int(seq_lens.max()), len(requests), 4, tiles.tile_n, torch.device("cpu"), tiles.block_q) > 1
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kv[0], kv[1], out, qsl, seq_lens, table, max_q, 0.125, max_seq_len=int(seq_lens.max()))
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    batch = make_batch(MIXED[:4], 4, 2, 64, 16, dtype, device, seed=2)
    out, ref = run_both(batch, 0.125, window=9)
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)


DECODES = [(c, 1) for c in (0, 5, 16, 33, 150, 1)]  # decode-only: the larger 8-bit tiles


@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, BF16_TOL), (torch.float16, BF16_TOL)]
)
def test_fp8_cache(device, dtype, tol, requests):
    """Keys and values stored as float8_e4m3fn: float32 queries attend in float32, 16-bit ones in float16."""
    query, kv, qsl, seq_lens, table, max_q = make_batch(requests, 4, 2, 64, 16, dtype, device, seed=4)
    kv = kv.to(torch.float8_e4m3fn)
    out, ref = run_both((query, kv, qsl, seq_lens, table, max_q), 0.125, window=13)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("softcap", [5.0, None], ids=["softcap", "base-2 scores"])
def test_fp8_cache_softcap_and_split_kv(device, softcap):
    """The float16 dots of an 8-bit cache keep the softcap (scale folded into the query) and the split-KV merge;
    without a softcap the scores are in base 2 and each segment stores its max back in natural units."""
    query, kv, qsl, seq_lens, table, max_q = make_batch(DECODES, 8, 2, 64, 16, torch.bfloat16, device, seed=5)
    kv = kv.to(torch.float8_e4m3fn)
    out, ref = run_both((query, kv, qsl, seq_lens, table, max_q), 0.3, softcap=softcap, num_segments=4)
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize(
    "requests, head_size, block_size, window, num_segments",
    [
        (DECODES, 64, 16, 13, None),  # the 8-bit decode tiles, whole blocks a tile
        (MIXED, 64, 16, 13, None),  # prefill tiles, whole blocks a tile
        (DECODES, 80, 16, None, 4),  # a padded head (a dimension mask), split-KV segments
        (MIXED, 64, 128, 9, None),  # blocks larger than a tile: slot by slot
    ],
    ids=["decodes", "mixed", "head-80-split", "large-blocks"],
)
def test_fp8_cache_with_slot_minor_values(device, requests, head_size, block_size, window, num_segments):
    """An 8-bit value cache slot-minor within each block (kv_cache.slot_minor) attends as the usual layout does.
    The slots past each request's end hold random values, which whole-block loads read and must weigh nothing."""
    query, kv, qsl, seq_lens, table, max_q = make_batch(requests, 8, 2, head_size, block_size, torch.bfloat16, device,
                                                        seed=6)
    kv = kv.to(torch.float8_e4m3fn)
    values = slot_minor(torch.empty_like(kv[1]))
    values.copy_(kv[1])
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kv[0], values, out, qsl, seq_lens, table, max_q, 0.125, window, num_segments=num_segments)
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.125, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)
    usual = torch.full_like(query, float("nan"))
    unified_attention(query, kv[0], kv[1], usual, qsl, seq_lens, table, max_q, 0.125, window, num_segments=num_segments)
    torch.testing.assert_close(out, usual, atol=2e-3, rtol=0)


def test_fp8_decode_tiles_by_value_layout(monkeypatch):
    import runtime_kernels.attention as attn

    assert attention_tiles(1, 4, 128, cache_bytes=1, values_slot_minor=True) == attn.AttentionTiles(16, 4, 64, 1, 3)
    assert attention_tiles(1, 4, 128, cache_bytes=1) == attn.AttentionTiles(16, 4, 128, 2, 3)
    assert attention_tiles(3, 4, 128, cache_bytes=1, values_slot_minor=True).tile_n == 64  # not a decode: as usual
    # prefill chunks: 128 score rows over an 8-bit cache (heads <= 128), 64 over a 16-bit one
    assert attention_tiles(1000, 4, 128, cache_bytes=1, values_slot_minor=True) == attn.AttentionTiles(128, 32, 64, 4, 2)
    assert attention_tiles(1000, 4, 128) == attn.AttentionTiles(64, 16, 64, 4, 2)
    assert attention_tiles(1000, 4, 256, cache_bytes=1).block_m == 32
    monkeypatch.setenv("RUNTIME_FP8_DECODE_TILES", "32,2,5")
    assert attn._tiles_setting("RUNTIME_FP8_DECODE_TILES") == (32, 2, 5)
    for bad in ("64,1", "48,1,3", "64,3,3", "64,1,0", "a,b,c"):
        monkeypatch.setenv("RUNTIME_FP8_DECODE_TILES", bad)
        with pytest.raises(ValueError, match=f"RUNTIME_FP8_DECODE_TILES='{bad}'"):
            attn._tiles_setting("RUNTIME_FP8_DECODE_TILES")


def test_reference_matches_per_token_loop():
    requests = [(3, 2), (0, 3)]
    query, kv, qsl, seq_lens, table, _ = make_batch(requests, 4, 2, 16, 4, torch.float32, "cpu", seed=3)
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.25, sliding_window=3, softcap=2.0)
    for req, (context, q_len) in enumerate(requests):
        blocks = table[req].long()
        for i in range(q_len):
            pos, row = context + i, int(qsl[req]) + i
            for h in range(4):
                keys = range(max(0, pos - 2), pos + 1)
                k = torch.stack([kv[0, blocks[p // 4], p % 4, h // 2] for p in keys])
                v = torch.stack([kv[1, blocks[p // 4], p % 4, h // 2] for p in keys])
                weights = (torch.tanh(k @ query[row, h] * 0.25 / 2.0) * 2.0).softmax(0)
                torch.testing.assert_close(ref[row, h], weights @ v, atol=1e-5, rtol=1e-5)


# Decodes first (as the scheduler orders a mixed step), then prefill chunks, then a decode that is not leading.
DECODES_FIRST = [(7, 1), (0, 1), (40, 1), (33, 1), (0, 9), (11, 19), (5, 1), (2, 17)]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("window", [None, 6])
def test_backend_runs_leading_decodes_as_their_own_launch(device, monkeypatch, cache_dtype, window):
    """The triton backend gives a mixed step's leading decodes the decode programs and the rest the prefill tiles,
    two launches with the result of one (against the reference); off, one launch; other batches, one launch."""
    import numpy as np

    from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
    from runtime_kernels import attention_backend as ab

    query, kv, qsl, seq_lens, table, max_q = make_batch(DECODES_FIRST, 8, 2, 64, 16, torch.bfloat16, device, seed=9)
    kv = kv.to(cache_dtype)
    backend = ab.TritonAttentionBackend()
    layer = AttentionLayerSpec(0, 8, 2, 64, 0.125, sliding_window=window)
    key = value = torch.zeros(0, 2, 64, dtype=torch.bfloat16, device=device)  # the cache already holds every key
    calls = []
    monkeypatch.setattr(ab, "reshape_and_cache", lambda *args: None)
    monkeypatch.setattr(ab, "unified_attention", lambda *args, **kw: calls.append(args[7]) or unified_attention(*args, **kw))

    def forward(split: bool):
        monkeypatch.setattr(backend, "split_decodes", split)
        metadata = backend.build_metadata(AttentionMetadata(
            len(DECODES_FIRST), query.shape[0], max_q, int(seq_lens.max()), qsl, seq_lens, table, None,
            qsl.cpu().numpy(), seq_lens.cpu().numpy(), 16))
        cache = torch.stack([kv[0], kv[1]])
        if backend.kv_block_layout(cache.dtype):  # an 8-bit cache keeps its values slot-minor
            slot_minor(cache[1]).copy_(kv[1])
        calls.clear()
        return backend.forward(layer, query.clone(), key, value, cache, metadata), list(calls), metadata.backend_data

    out, launches, data = forward(split=True)
    assert launches == [1, max_q] and data.num_decodes == 4 and data.rest_query_start_loc.tolist() == [0, 9, 28, 29, 46]
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.125, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)
    one, launches, data = forward(split=False)
    assert launches == [max_q] and data is None
    torch.testing.assert_close(out.float(), one.float(), atol=BF16_TOL, rtol=BF16_TOL)
    assert ab.leading_decodes(np.array([0, 1, 2, 3])) == 3 and ab.leading_decodes(np.array([0, 4, 5])) == 0
    assert ab.leading_decodes(None) == 0
