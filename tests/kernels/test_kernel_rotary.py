"""rotary_embedding (Triton) against its reference and the model's RotaryEmbedding (Llama 3 scaling)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime.models.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from runtime_kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref  # noqa: E402

from support.kernel_testing import tolerance

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("params", [DEFAULT, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_matches_reference(device, params, dtype, head_size):
    gen = torch.Generator().manual_seed(head_size)
    cache = build_cos_sin_cache(params, head_size, 256, device)
    positions = torch.tensor([0, 3, 255, 17, 100], device=device)
    qkv = torch.randn(5, 4 + 2 * 3, head_size, generator=gen).to(device=device, dtype=dtype)
    q, k = qkv[:, :4], qkv[:, 4:7]  # strided views of a fused projection
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    tol = tolerance(dtype)
    torch.testing.assert_close(out_q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(out_k, ref_k, atol=tol, rtol=tol)


def test_cache_matches_model_rotary():
    rope = RotaryEmbedding(32, dict(LLAMA3), max_position=64)
    positions = torch.tensor([1, 40, 63, 7])
    cos, sin = rope(positions, torch.float32)
    cache = build_cos_sin_cache(dict(LLAMA3), 32, 64)
    x = torch.randn(4, 3, 32)
    expected = apply_rotary(x, cos, sin)
    got, _ = rotary_embedding_ref(positions, x, x[:, :1], cache)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
