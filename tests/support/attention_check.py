"""A paged attention backend against naive attention on random data.

Batches mix prefills (with and without cached context) and decodes, over block tables
whose blocks are shuffled, with grouped kv heads, sliding windows and soft-capping.
Every backend over the KV layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``
is checked the same way (core's ``sdpa``, the CPU plugin's ``cpu_paged``).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 48
HEAD_SIZE = 16
# (tokens already cached, new tokens this step) per request.
REQUESTS = [(0, 9), (7, 1), (0, 1), (13, 1), (4, 6), (11, 3), (2, 1), (20, 1)]
# (num_heads, num_kv_heads, sliding window, soft cap) of the layers checked.
LAYER_SHAPES = [(4, 2, None, None), (4, 2, 5, None), (6, 1, 3, None), (2, 2, None, 5.0), (4, 2, 5, 5.0), (4, 4, 40, None)]


def naive_attention(q, k, v, q_positions, spec: AttentionLayerSpec) -> torch.Tensor:
    """q [n, heads, d] at ``q_positions``; k, v [seq_len, kv_heads, d] for positions 0..seq_len-1."""
    group = spec.num_heads // spec.num_kv_heads
    out = torch.empty_like(q)
    for t, pos in enumerate(q_positions):
        for h in range(spec.num_heads):
            first = 0 if spec.sliding_window is None else max(0, pos - spec.sliding_window + 1)
            keys = list(range(first, pos + 1))
            scores = torch.stack([q[t, h] @ k[j, h // group] for j in keys]) * spec.scale
            if spec.logits_soft_cap is not None:
                scores = torch.tanh(scores / spec.logits_soft_cap) * spec.logits_soft_cap
            weights = scores.softmax(dim=0)
            out[t, h] = sum(w * v[j, h // group] for w, j in zip(weights, keys))
    return out


def build_batch(spec: AttentionLayerSpec, seed: int, requests=REQUESTS):
    """Random cache contents, new q/k/v and metadata for ``requests`` (tokens cached, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, HEAD_SIZE)
    flat = kv_cache.view(2, -1, spec.num_kv_heads, HEAD_SIZE)
    tables, full_k, full_v, slots = [], [], [], []
    for context, q_len in requests:
        seq_len = context + q_len
        blocks = [free.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        req_slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        k = torch.randn(seq_len, spec.num_kv_heads, HEAD_SIZE, generator=gen)
        v = torch.randn(seq_len, spec.num_kv_heads, HEAD_SIZE, generator=gen)
        flat[0, req_slots[:context]] = k[:context]  # the cached context
        flat[1, req_slots[:context]] = v[:context]
        tables.append(blocks)
        full_k.append(k)
        full_v.append(v)
        slots.extend(req_slots[context:])
    q_lens = [q for _, q in requests]
    seq_lens = [c + q for c, q in requests]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        num_reqs=len(requests),
        num_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32),
        block_size=BLOCK_SIZE,
    )
    query = torch.randn(int(qsl[-1]), spec.num_heads, HEAD_SIZE, generator=gen)
    return kv_cache, metadata, query, full_k, full_v


def check_matches_naive_attention(backend, layer_shape: tuple, prebuilt: bool, requests=REQUESTS, attend=None) -> None:
    """``backend.forward`` (or ``attend(spec, query, key, value, kv_cache, metadata)``) equals naive
    attention for every request, and wrote the step's keys and values."""
    num_heads, num_kv_heads, window, soft_cap = layer_shape
    spec = AttentionLayerSpec(0, num_heads, num_kv_heads, HEAD_SIZE, HEAD_SIZE**-0.5, window, soft_cap)
    kv_cache, metadata, query, full_k, full_v = build_batch(spec, seed=num_heads * 10 + (window or 0), requests=requests)
    if prebuilt:
        metadata = backend.build_metadata(metadata)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, requests)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, requests)])

    out = (attend or backend.forward)(spec, query, new_k, new_v, kv_cache, metadata)

    start = 0
    for (context, q_len), k, v in zip(requests, full_k, full_v):
        q = query[start : start + q_len]
        expected = naive_attention(q, k, v, list(range(context, context + q_len)), spec)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_SIZE)
    torch.testing.assert_close(flat[0, metadata.slot_mapping], new_k)
    torch.testing.assert_close(flat[1, metadata.slot_mapping], new_v)
