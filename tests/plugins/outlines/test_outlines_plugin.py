"""The installed runtime-plugin-outlines registers the ``outlines`` guided backend through its
entry point, and the registry builds a backend that satisfies the contract."""

from __future__ import annotations

import json

import pytest

from runtime import plugins
from runtime.structured_output import Grammar, GuidedBackend, GuidedKind

SMOLLM2_VOCAB_SIZE = 49152  # the model's logits width


def test_entry_point_registers_outlines(plugin_manager):
    component = plugin_manager.registry("guided_backend").component("outlines")
    assert component.plugin == "outlines"
    assert plugin_manager.infos["outlines"].distribution == "runtime-plugin-outlines"
    assert plugin_manager.infos["outlines"].registered == {"guided_backend": ["outlines"]}


def test_allow_list_loads_only_outlines():
    manager = plugins.PluginManager(["outlines"])
    assert manager.registry("guided_backend").names() == ["outlines"]
    assert "cpu" not in manager.registry("platform")


def test_registry_builds_a_checked_backend(plugin_manager, smollm2_tokenizer):
    backend = plugins.get_registry("guided_backend").create("outlines", smollm2_tokenizer, SMOLLM2_VOCAB_SIZE)
    assert isinstance(backend, GuidedBackend)
    grammar = backend.compile(GuidedKind.CHOICE, json.dumps(["left", "right"]))
    assert isinstance(grammar, Grammar)
    with pytest.raises(ValueError, match="not grammar"):
        backend.compile(GuidedKind.GRAMMAR, "root ::= x")
