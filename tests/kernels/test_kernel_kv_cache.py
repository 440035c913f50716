"""reshape_and_cache (Triton) against reshape_and_cache_ref (index_copy_)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime_kernels.kv_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_size", [(2, 64), (3, 128)])
def test_matches_reference(device, dtype, num_kv_heads, head_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 4, 9
    # A strided key (a slice of a fused qkv output) and a padding token marked -1.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[4] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    reshape_and_cache_ref(key, value, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)  # including: the padding token (-1) wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_tokens, num_kv_heads, head_size = 5, 4, 7, 2, 64
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype) * 4
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, device=device, dtype=torch.float8_e4m3fn)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    reshape_and_cache_ref(key, value, expected[0], expected[1], slots)
    # Bitwise: the kernel rounds to e4m3 exactly as torch's conversion does.
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.float().abs().sum() > 0
