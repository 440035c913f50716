"""Core's reference ``sdpa`` backend: against naive attention, and registered for every platform."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.backend import select_attention_backend
from runtime.attention.sdpa import SdpaAttentionBackend
from runtime.platforms import Platform
from runtime import plugins

from support.attention_check import LAYER_SHAPES, check_matches_naive_attention


@pytest.mark.parametrize("layer_shape", LAYER_SHAPES, ids=str)
@pytest.mark.parametrize("prebuilt", [True, False], ids=["build_metadata", "lazy"])
def test_matches_naive_attention(layer_shape, prebuilt):
    check_matches_naive_attention(SdpaAttentionBackend(), layer_shape, prebuilt)


def test_kv_cache_shape():
    assert SdpaAttentionBackend().kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


class AnyDevice(Platform):
    name = "any-device"

    def is_available(self):
        return True

    def kv_cache_memory_bytes(self, cache_config, model_memory_bytes):
        return 1 << 20


def test_registered_by_the_core_for_every_platform():
    manager = plugins.PluginManager([])  # no plugin at all: the core alone
    component = manager.registry("attention_backend").component("sdpa")
    assert component.plugin == plugins.BUILTIN_PLUGIN_NAME and component.options.get("platforms") is None
    saved = plugins._manager
    plugins.reset_plugin_manager(manager)
    try:
        backend = select_attention_backend("sdpa", AnyDevice(), torch.float16, head_size=256)
    finally:
        plugins.reset_plugin_manager(saved)
    assert isinstance(backend, SdpaAttentionBackend)
