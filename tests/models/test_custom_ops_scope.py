"""custom_ops_scope / lookup, and the modules that pick their fused op up at construction.

The "fused" ops here are plain-torch stand-ins written in this file (no Triton), so
these tests check the plumbing and the residual-stream contract, not kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models.layers import GemmaRMSNorm, RMSNorm, SiluAndMul
from runtime.models.ops import CUSTOM_OPS, custom_ops_scope, lookup
from runtime.models.rotary import AngleRotation, FusedRotation, RotaryEmbedding, apply_rotary


def norm_ref(x, weight, eps, gemma=False):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype) if gemma else weight * normed.to(x.dtype)


def add_norm_ref(x, residual, weight, eps, gemma=False):
    summed = x + residual
    return norm_ref(summed, weight, eps, gemma), summed


def rotary_ref(positions, query, key, cos_sin_cache):
    """In place, as the platform op: rotate with cos | sin rows of the cache."""
    half = query.shape[-1] // 2
    cos, sin = cos_sin_cache[positions, :half], cos_sin_cache[positions, half:]
    query.copy_(apply_rotary(query, cos, sin))
    key.copy_(apply_rotary(key, cos, sin))
    return query, key


def recording(calls: list[str], name: str, fn):
    def op(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return op


def test_lookup_outside_a_scope_finds_nothing():
    assert all(lookup(name) is None for name in CUSTOM_OPS)


def test_scope_offers_known_ops_ignores_unknown_and_restores():
    def outer_op(x):
        return x

    def inner_op(x):
        return x

    with custom_ops_scope({"silu_and_mul": outer_op, "flash_mla": outer_op}):
        assert lookup("silu_and_mul") is outer_op
        assert lookup("rms_norm") is None
        with pytest.raises(ValueError, match="unknown custom op 'flash_mla'; known: rms_norm"):
            lookup("flash_mla")
        with custom_ops_scope({"rms_norm": inner_op}):
            assert lookup("rms_norm") is inner_op
            assert lookup("silu_and_mul") is None  # a scope replaces, it does not merge
        assert lookup("silu_and_mul") is outer_op
        with pytest.raises(RuntimeError), custom_ops_scope({"rms_norm": inner_op}):
            raise RuntimeError("model construction failed")
        assert lookup("rms_norm") is None
    assert lookup("silu_and_mul") is None


def test_scope_rejects_a_known_name_bound_to_a_non_callable():
    with pytest.raises(ValueError, match="custom op 'rms_norm' must be callable, got str"):
        with custom_ops_scope({"rms_norm": "rms_norm"}):
            pass


@pytest.mark.parametrize("cls, gemma", [(RMSNorm, False), (GemmaRMSNorm, True)])
def test_norm_uses_the_ops_of_its_construction_scope(cls, gemma):
    calls: list[str] = []
    ops = {"rms_norm": recording(calls, "rms_norm", norm_ref),
           "fused_add_rms_norm": recording(calls, "fused_add_rms_norm", add_norm_ref)}
    with custom_ops_scope(ops):
        fused = cls(16, eps=1e-5)
    plain = cls(16, eps=1e-5)  # built after the scope: plain torch
    with torch.no_grad():
        plain.weight.copy_(torch.randn(16) * 0.3)
        fused.weight.copy_(plain.weight)
    x, residual = torch.randn(2, 5, 16), torch.randn(2, 5, 16)

    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(plain(x), norm_ref(x, plain.weight, 1e-5, gemma), rtol=0, atol=0)
    out, summed = fused(x, residual)
    plain_out, plain_summed = plain(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(plain_summed, x + residual)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(plain_out, plain(x + residual), rtol=0, atol=0)
    assert calls == ["rms_norm", "fused_add_rms_norm"]


def test_norm_without_fused_add_adds_then_uses_rms_norm():
    calls: list[str] = []
    with custom_ops_scope({"rms_norm": recording(calls, "rms_norm", norm_ref)}):
        norm = GemmaRMSNorm(8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, norm_ref(x + residual, norm.weight, 1e-6, gemma=True), rtol=0, atol=0)
    assert calls == ["rms_norm"]


def test_silu_and_mul_uses_the_op():
    calls: list[str] = []
    with custom_ops_scope({"silu_and_mul": recording(calls, "silu_and_mul", lambda x: SiluAndMul()(x))}):
        act = SiluAndMul()
    x = torch.randn(4, 12)
    torch.testing.assert_close(act(x), F.silu(x[:, :6]) * x[:, 6:], rtol=0, atol=0)
    assert calls == ["silu_and_mul"]


def test_rotary_rotation_is_fused_only_inside_a_scope():
    params = {"rope_type": "default", "rope_theta": 10000.0}
    calls: list[str] = []
    with custom_ops_scope({"rotary_embedding": recording(calls, "rotary_embedding", rotary_ref)}):
        fused = RotaryEmbedding(8, params, max_position=32)
    plain = RotaryEmbedding(8, params, max_position=32)
    positions = torch.tensor([0, 5, 31, 2])
    q, k = torch.randn(4, 3, 8), torch.randn(4, 1, 8)

    plain_rotation = plain.rotation(positions, torch.float32)
    assert isinstance(plain_rotation, AngleRotation)
    expected_q, expected_k = plain_rotation.apply(q, k)
    fused_rotation = fused.rotation(positions, torch.float32)
    assert isinstance(fused_rotation, FusedRotation)
    assert fused_rotation.cos_sin_cache.shape == (32, 8)
    got_q, got_k = fused_rotation.apply(q.clone(), k.clone())
    torch.testing.assert_close(got_q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, expected_k, rtol=0, atol=0)
    assert calls == ["rotary_embedding"]


def test_rotary_cache_is_built_for_the_positions_device_even_when_constructed_on_meta():
    with custom_ops_scope({"rotary_embedding": rotary_ref}), torch.device("meta"):
        rope = RotaryEmbedding(8, {"rope_type": "default", "rope_theta": 10000.0}, max_position=16)
    rotation = rope.rotation(torch.tensor([3]), torch.float32)
    assert rotation.cos_sin_cache.device.type == "cpu" and rotation.cos_sin_cache.dtype == torch.float32
