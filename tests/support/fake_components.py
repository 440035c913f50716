"""Minimal components that satisfy their contracts, for plugins defined inside tests."""

from __future__ import annotations


class FakeBackend:
    """An attention backend with every method of the contract; never runs a model."""

    name = "fake_attn"

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, metadata):
        return metadata

    def forward(self, layer, query, key, value, kv_cache, metadata):
        raise NotImplementedError("never run")
