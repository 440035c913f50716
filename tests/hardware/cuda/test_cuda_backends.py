"""The ``triton`` and ``sdpa`` backends against the plain-torch paged attention reference.

Each step mixes prefills (with and without cached context), multi-block chunks and
decodes over shuffled block tables. Several layers (plain, windowed, soft-capped) share
one step's metadata, as in a model. Without a GPU the Triton backend runs in Triton's
interpreter on the CPU.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
from runtime.attention.sdpa import SdpaAttentionBackend

pytest.importorskip("triton")

from runtime_kernels.attention_backend import TritonAttentionBackend  # noqa: E402
from runtime_kernels.attention import unified_attention_ref  # noqa: E402

BLOCK_SIZE = 4
HEAD_SIZE = 32
# (tokens already cached, new tokens this step) per request.
REQUESTS = [(0, 9), (7, 1), (0, 1), (13, 1), (4, 6), (11, 3), (2, 1), (20, 1)]
LAYERS = [
    AttentionLayerSpec(0, 4, 2, HEAD_SIZE, HEAD_SIZE**-0.5),
    AttentionLayerSpec(1, 4, 2, HEAD_SIZE, HEAD_SIZE**-0.5, sliding_window=5),
    AttentionLayerSpec(2, 4, 2, HEAD_SIZE, 0.1, sliding_window=3, logits_soft_cap=20.0),
    AttentionLayerSpec(3, 4, 4, HEAD_SIZE, 0.2),
]


def build_step(dtype, device, seed=0):
    """Metadata, shuffled block tables and (cache, q, k, v) per layer with random cached context."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + q) / BLOCK_SIZE) for c, q in REQUESTS) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil((c + q) / BLOCK_SIZE))] for c, q in REQUESTS]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, (c, q) in zip(tables, REQUESTS) for p in range(c, c + q)]
    q_lens, seq_lens = [q for _, q in REQUESTS], [c + q for c, q in REQUESTS]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        num_reqs=len(REQUESTS), num_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32), block_size=BLOCK_SIZE,
    )
    tensors = []
    for spec in LAYERS:
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        cache = rand(2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, HEAD_SIZE)  # stale data everywhere
        n = int(qsl[-1])
        tensors.append((cache, rand(n, spec.num_heads, HEAD_SIZE), rand(n, spec.num_kv_heads, HEAD_SIZE),
                        rand(n, spec.num_kv_heads, HEAD_SIZE)))
    return metadata, tensors


def expected_output(spec, metadata, cache, q, k, v):
    cache = cache.clone()
    flat = cache.view(2, -1, spec.num_kv_heads, HEAD_SIZE)
    flat[0, metadata.slot_mapping], flat[1, metadata.slot_mapping] = k, v
    out = unified_attention_ref(q, cache[0], cache[1], metadata.query_start_loc, metadata.seq_lens,
                                metadata.block_table, spec.scale, spec.sliding_window, spec.logits_soft_cap)
    return out, cache


# bfloat16 is checked at kernel level under the interpreter; here only when compiled for a GPU.
DTYPES = [torch.float32] + ([torch.bfloat16] if os.environ.get("TRITON_INTERPRET") == "0" else [])


@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, SdpaAttentionBackend])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_matches_reference(device, backend_cls, dtype):
    backend = backend_cls()
    metadata, tensors = build_step(dtype, device)
    metadata = backend.build_metadata(metadata)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for spec, (cache, q, k, v) in zip(LAYERS, tensors):
        expected, expected_cache = expected_output(spec, metadata, cache, q, k, v)
        out = backend.forward(spec, q, k, v, cache, metadata)
        assert torch.equal(cache, expected_cache), f"layer {spec.layer_idx}: cache write differs"
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol, msg=f"layer {spec.layer_idx}")


def test_kv_cache_shape_is_the_cpu_layout():
    for backend in (TritonAttentionBackend(), SdpaAttentionBackend()):
        assert backend.kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
