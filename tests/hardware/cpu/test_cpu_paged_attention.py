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


def test_only_the_decode_path_is_its_own():
    """Everything but decodes is core's reference backend (tests/attention)."""
    assert issubclass(CPUPagedAttentionBackend, SdpaAttentionBackend)
    own = {name for name in vars(CPUPagedAttentionBackend) if not name.startswith("__")}
    assert own == {"name", "decode"}


def test_kv_cache_shape():
    assert CPUPagedAttentionBackend().kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
