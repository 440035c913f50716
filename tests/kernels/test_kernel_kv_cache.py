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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(4, 2, 64), (6, 3, 80)])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["same", "fp8"])
def test_rotary_and_cache_write_in_one_launch_match_the_two(device, dtype, num_heads, num_kv_heads, head_size, cache_dtype):
    """rotary_reshape_and_cache leaves the query and the caches exactly as rotary_embedding then reshape_and_cache
    do (a padding token's query rotated, nothing stored for it), and the key tensor as it was."""
    from runtime_kernels.kv_cache import rotary_reshape_and_cache
    from runtime_kernels.rotary import build_cos_sin_cache, rotary_embedding

    gen = torch.Generator().manual_seed(head_size + num_heads)
    num_blocks, block_size, num_tokens = 6, 4, 9
    cos_sin = build_cos_sin_cache({"rope_type": "default", "rope_theta": 10000.0}, head_size, 64, device)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
    # q, k and v strided in a fused qkv projection's output, as a model hands them over.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype) * 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[4] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    cache = cache.to(cache_dtype or dtype)

    def run(fused: bool):
        x, c = qkv.clone(), cache.clone()
        q, k, v = x[:, :num_heads], x[:, num_heads:num_heads + num_kv_heads], x[:, num_heads + num_kv_heads:]
        if fused:
            k_before = k.clone()
            rotary_reshape_and_cache(positions, q, k, v, c[0], c[1], slots, cos_sin)
            assert torch.equal(k, k_before)
        else:
            rotary_embedding(positions, q, k, cos_sin)
            reshape_and_cache(k, v, c[0], c[1], slots)
        return q, c

    (q_fused, cache_fused), (q_apart, cache_apart) = run(True), run(False)
    assert torch.equal(q_fused, q_apart)
    assert torch.equal(cache_fused.view(torch.uint8), cache_apart.view(torch.uint8))
    assert not torch.equal(q_fused, qkv[:, :num_heads])  # it did rotate
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat = cache_fused.view(2, num_blocks * block_size, -1).cpu()
    assert torch.equal(flat[:, untouched].view(torch.uint8), cache.view(2, num_blocks * block_size, -1).cpu()[:, untouched].view(torch.uint8))
