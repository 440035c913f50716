"""reshape_and_cache (Triton) against reshape_and_cache_ref (index_copy_)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime_kernels.kv_cache import reshape_and_cache, reshape_and_cache_ref, slot_minor  # noqa: E402


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


def test_slot_minor_view_orders_each_block_heads_dims_slots():
    cache = torch.zeros(3, 4, 2, 5)  # [blocks, slots, kv heads, head]
    view = slot_minor(cache)
    assert view.shape == cache.shape
    view[2, 1, 1, 3] = 7.0
    # block 2's own bytes, read as [kv heads, head, slots]
    assert cache[2].reshape(2, 5, 4)[1, 3, 1] == 7.0 and cache.count_nonzero() == 1
    with pytest.raises(ValueError, match="blocks are contiguous"):
        slot_minor(view)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float32)],
                         ids=["fp8", "same"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotary"])
def test_slot_minor_values_written_where_the_reference_writes(device, dtype, cache_dtype, rotate):
    """Both writes (plain, and with the rotary embedding) store a slot-minor value cache's values where indexing the
    view puts them, bit for bit, and leave the key cache as the usual layout's write does."""
    from runtime_kernels.kv_cache import rotary_reshape_and_cache
    from runtime_kernels.rotary import build_cos_sin_cache

    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_tokens, num_kv_heads, head_size = 5, 16, 23, 2, 64
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(device=device, dtype=dtype) * 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[6] = -1
    usual = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, device=device, dtype=cache_dtype)
    minor = usual.clone()
    if rotate:
        cos_sin = build_cos_sin_cache({"rope_type": "default", "rope_theta": 10000.0}, head_size, 64, device)
        positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
        query = torch.randn(num_tokens, 4, head_size, generator=gen).to(device=device, dtype=dtype)
        rotary_reshape_and_cache(positions, query.clone(), key, value, usual[0], usual[1], slots, cos_sin)
        rotary_reshape_and_cache(positions, query.clone(), key, value, minor[0], slot_minor(minor[1]), slots, cos_sin)
    else:
        reshape_and_cache(key, value, usual[0], usual[1], slots)
        reshape_and_cache(key, value, minor[0], slot_minor(minor[1]), slots)
    assert torch.equal(minor[0].view(torch.uint8), usual[0].view(torch.uint8))
    assert torch.equal(slot_minor(minor[1]).contiguous().view(torch.uint8), usual[1].view(torch.uint8))
    assert not torch.equal(minor[1].view(torch.uint8), usual[1].view(torch.uint8))  # the bytes did move
    expected = torch.zeros_like(usual)
    reshape_and_cache_ref(key, value, expected[0], slot_minor(expected[1]), slots)
    assert torch.equal(minor[1].view(torch.uint8), expected[1].view(torch.uint8))
