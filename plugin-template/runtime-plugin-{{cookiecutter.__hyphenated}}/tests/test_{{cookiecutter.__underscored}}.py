"""Tests of runtime-plugin-{{ cookiecutter.__hyphenated }}: registration, selection, correctness."""

import math

import numpy as np
import pytest
import torch

from runtime import plugins
from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata, select_attention_backend
from runtime.attention.sdpa import SdpaAttentionBackend
from runtime.platforms import Platform

from runtime_{{ cookiecutter.__underscored }}.attention import {{ cookiecutter.__class_prefix }}AttentionBackend

PLUGIN = "{{ cookiecutter.__hyphenated }}"
BACKEND = "{{ cookiecutter.__underscored }}_sdpa"


class StubCpu(Platform):
    name = "cpu"

    def is_available(self):
        return True

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
        return 1 << 20


@pytest.fixture
def manager():
    """A plugin manager that loads only this plugin, through its entry point."""
    saved = plugins._manager
    manager = plugins.PluginManager([PLUGIN])
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)


def test_entry_point_registers_the_backend(manager):
    info = manager.infos[PLUGIN]
    assert info.distribution == "runtime-plugin-{{ cookiecutter.__hyphenated }}"
    assert info.registered == {"attention_backend": [BACKEND]}
    component = manager.registry("attention_backend").component(BACKEND)
    assert component.options["platforms"] == ["cpu"]
    assert component.plugin == PLUGIN


def test_selected_by_name(manager):
    backend = select_attention_backend(BACKEND, StubCpu(), torch.float32, head_size=8)
    assert isinstance(backend, {{ cookiecutter.__class_prefix }}AttentionBackend)
    assert backend.name == BACKEND
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_attention_backend("nope", StubCpu(), torch.float32, head_size=8)


# (cached tokens before the step, tokens of the step) per request: a prefill, a
# decode, a chunked prefill over cached context and a longer decode.
REQUESTS = [(0, 5), (6, 1), (4, 3), (9, 1)]
BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 16, 4, 2, 8


def dense_attention(q, k, v, layer):
    """Reference: q [q_len, heads, d] are the last positions of k/v [seq, kv_heads, d]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    out = torch.empty_like(q)
    for h in range(layer.num_heads):
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = 0 if layer.sliding_window is None else max(0, pos - layer.sliding_window + 1)
            keys, values = k[first : pos + 1, h // group], v[first : pos + 1, h // group]
            scores = keys @ q[i, h] * layer.scale
            if layer.logits_soft_cap is not None:
                scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
            out[i, h] = scores.softmax(dim=0) @ values
    return out


def make_step(generator):
    """A paged KV cache holding each request's context, and the step's new tokens."""
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    flat_k, flat_v = cache[0].view(-1, NUM_KV_HEADS, HEAD_SIZE), cache[1].view(-1, NUM_KV_HEADS, HEAD_SIZE)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()  # scattered blocks
    max_blocks = max(math.ceil((c + n) / BLOCK_SIZE) for c, n in REQUESTS)
    block_table = torch.zeros(len(REQUESTS), max_blocks, dtype=torch.int32)
    queries, keys, values, slot_mapping, full = [], [], [], [], []
    for r, (context, new) in enumerate(REQUESTS):
        seq_len = context + new
        blocks = [free_blocks.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        block_table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(seq_len)]
        q = torch.randn(new, NUM_HEADS, HEAD_SIZE, generator=generator)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        flat_k[slots[:context]], flat_v[slots[:context]] = k[:context], v[:context]
        queries.append(q), keys.append(k[context:]), values.append(v[context:])
        slot_mapping += slots[context:]
        full.append((q, k, v))
    q_lens = [n for _, n in REQUESTS]
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in REQUESTS], dtype=np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(REQUESTS),
        num_tokens=int(query_start_loc[-1]),
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=block_table,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK_SIZE,
    )
    return cache, torch.cat(queries), torch.cat(keys), torch.cat(values), metadata, full


@pytest.mark.parametrize("backend_cls", [SdpaAttentionBackend, {{ cookiecutter.__class_prefix }}AttentionBackend])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (3, None), (None, 5.0)])
def test_paged_attention_matches_dense_reference(backend_cls, window, soft_cap):
    generator = torch.Generator().manual_seed(0)
    cache, query, key, value, metadata, full = make_step(generator)
    layer = AttentionLayerSpec(0, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, window, soft_cap)
    backend = backend_cls()
    assert backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) == tuple(cache.shape)
    calls = {{ cookiecutter.__class_prefix }}AttentionBackend.forward_calls
    out = backend.forward(layer, query, key, value, cache, backend.build_metadata(metadata))
    expected = torch.cat([dense_attention(q, k, v, layer) for q, k, v in full])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if backend_cls is {{ cookiecutter.__class_prefix }}AttentionBackend:
        assert {{ cookiecutter.__class_prefix }}AttentionBackend.forward_calls == calls + 1
    # the step's keys and values were written into the cache
    flat_k = cache[0].view(-1, NUM_KV_HEADS, HEAD_SIZE)
    torch.testing.assert_close(flat_k[metadata.slot_mapping], key)

