"""CPUPagedAttentionBackend against naive attention on random data (support.attention_check).

Batches mix prefills (with and without cached context) and decodes, over block tables
whose blocks are shuffled, with grouped kv heads, sliding windows and soft-capping.
"""

from __future__ import annotations

import pytest

from runtime.attention.sdpa import SdpaAttentionBackend
from runtime_cpu.attention import CPUPagedAttentionBackend

from support.attention_check import LAYER_SHAPES, check_matches_naive_attention


@pytest.mark.parametrize("layer_shape", LAYER_SHAPES, ids=str)
@pytest.mark.parametrize("prebuilt", [True, False], ids=["build_metadata", "lazy"])
def test_matches_naive_attention(layer_shape, prebuilt):
    check_matches_naive_attention(CPUPagedAttentionBackend(), layer_shape, prebuilt)


DECODES = [(7, 1), (0, 1), (13, 1), (2, 1), (20, 1), (3, 1)]  # (tokens cached, new tokens): one each


@pytest.mark.parametrize("layer_shape", LAYER_SHAPES, ids=str)
def test_traced_decode_matches_naive_attention(layer_shape):
    """The decode that compiled steps trace (runtime.models.attention_op), run as plain torch ops
    on the inputs a compiled step gives it: rows of different lengths, padded block tables."""
    backend = CPUPagedAttentionBackend()

    def traced(spec, query, key, value, kv_cache, metadata):
        inputs = backend.traced_decode_inputs(backend.build_metadata(metadata))
        assert inputs.block_table.is_contiguous() and inputs.block_table.shape[1] >= 2
        return backend.traced_decode(spec, query, key, value, kv_cache, inputs)

    check_matches_naive_attention(backend, layer_shape, prebuilt=False, requests=DECODES, attend=traced)
    check_matches_naive_attention(backend, layer_shape, prebuilt=False, requests=[(2, 1)], attend=traced)  # one block


def test_only_the_decode_path_is_its_own():
    """Everything but decodes is core's reference backend (tests/attention)."""
    assert issubclass(CPUPagedAttentionBackend, SdpaAttentionBackend)
    own = {name for name in vars(CPUPagedAttentionBackend) if not name.startswith("__")}
    assert own == {"name", "decode", "traced_decode_inputs", "traced_decode"}


def test_kv_cache_shape():
    assert CPUPagedAttentionBackend().kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
