"""The CUDA decode attention over an FP8 cache (runtime_kernels.attention_cuda, ``RUNTIME_FP8_DECODE_CUDA=1``)
against unified_attention_ref and the Triton kernel it stands in for.

GPU only: the kernel is CUDA C compiled by NVRTC. Decode batches of short and long contexts (keys past a
warp's tile, a block's four warps, and empty segments), 1, 2 and 4 query heads per KV head, head sizes 64,
128 and 256, block sizes 16 and 32 over shuffled block tables, both 16-bit query types, one segment and split-KV
(its rows merged by the Triton merge kernel), CUDA-graph replays; steps it does not take go to the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import attention_cuda
from runtime_kernels.attention import unified_attention, unified_attention_ref
from support.kernel_testing import BF16_TOL
from test_kernel_attention import make_batch

pytestmark = pytest.mark.gpu

DECODES = [(c, 1) for c in (0, 5, 16, 33, 150, 1, 700)]


@pytest.fixture
def launches(monkeypatch):
    """The kernel switched on; the segment counts of its launches recorded."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu test ran without a GPU")
    monkeypatch.setattr(attention_cuda, "ENABLED", True)
    seen = []
    decode = attention_cuda.decode_attention
    monkeypatch.setattr(attention_cuda, "decode_attention", lambda *a: seen.append(a[-1]) or decode(*a))
    return seen


def _fp8_batch(requests, num_heads, num_kv_heads, head_size, block_size, dtype, seed):
    query, kv, qsl, seq_lens, table, max_q = make_batch(requests, num_heads, num_kv_heads, head_size, block_size,
                                                        dtype, "cuda", seed=seed)
    return query, kv.to(torch.float8_e4m3fn), qsl, seq_lens, table, max_q


def _attend(batch, scale, num_segments=None, **kw):
    query, kv, qsl, seq_lens, table, max_q = batch
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kv[0], kv[1], out, qsl, seq_lens, table, max_q, scale, num_segments=num_segments,
                      max_seq_len=int(seq_lens.max()), **kw)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", [
    (32, 8, 128, 16),  # Llama-3-8B: 4 queries a KV head
    (4, 4, 64, 16),    # 1
    (8, 4, 256, 32),   # 2, Gemma's head size, larger blocks
])
@pytest.mark.parametrize("num_segments", [1, 4, 16])
def test_matches_reference_and_the_triton_kernel(launches, dtype, num_heads, num_kv_heads, head_size, block_size,
                                                 num_segments, monkeypatch):
    batch = _fp8_batch(DECODES, num_heads, num_kv_heads, head_size, block_size, dtype, seed=head_size + num_segments)
    query, kv, qsl, seq_lens, table, _ = batch
    scale = head_size ** -0.5
    out = _attend(batch, scale, num_segments)
    assert launches == [num_segments]
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)
    monkeypatch.setattr(attention_cuda, "ENABLED", False)
    triton_out = _attend(batch, scale, num_segments)
    torch.testing.assert_close(out.float(), triton_out.float(), atol=BF16_TOL, rtol=BF16_TOL)


def test_the_launcher_splits_a_small_batch_and_replays_in_a_graph(launches):
    """One long request (8 KV heads: the launcher splits its keys) captured in a CUDA graph and replayed after
    its cache changed: the replay sees the new values."""
    batch = _fp8_batch([(1500, 1)], 32, 8, 128, 16, torch.bfloat16, seed=3)
    query, kv, qsl, seq_lens, table, _ = batch
    out = _attend(batch, 0.088)
    assert launches and launches[0] > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _attend(batch, 0.088)
    kv.copy_(torch.randn(kv.shape, device="cuda").to(torch.float8_e4m3fn))
    graph.replay()
    torch.cuda.synchronize()
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.088)
    torch.testing.assert_close(replayed.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)
    assert not torch.equal(replayed, out)


@pytest.mark.parametrize("case", ["prefill", "window", "softcap", "group of 3", "group of 8", "bf16 cache"])
def test_steps_it_does_not_take_go_to_the_triton_kernel(launches, case):
    requests = [(4, 6), (9, 1)] if case == "prefill" else DECODES
    heads = {"group of 3": (6, 2), "group of 8": (16, 2)}.get(case, (8, 2))
    batch = _fp8_batch(requests, *heads, 64, 16, torch.bfloat16, seed=7)
    if case == "bf16 cache":
        batch = (batch[0], batch[1].to(torch.bfloat16), *batch[2:])
    kw = {"sliding_window": 5} if case == "window" else {"softcap": 20.0} if case == "softcap" else {}
    query, kv, qsl, seq_lens, table, _ = batch
    out = _attend(batch, 0.125, **kw)
    assert launches == []
    ref = unified_attention_ref(query, kv[0], kv[1], qsl, seq_lens, table, 0.125, kw.get("sliding_window"),
                                kw.get("softcap"))
    torch.testing.assert_close(out.float(), ref.float(), atol=BF16_TOL, rtol=BF16_TOL)
