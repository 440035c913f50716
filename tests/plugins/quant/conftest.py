"""Tiny float32 checkpoints the quantized ones are written from, built once per test module."""

from __future__ import annotations

import pytest

from runtime.testing.models import build_untokenized_model


@pytest.fixture(scope="module")
def float_checkpoints(tmp_path_factory):
    """arch -> a tiny float32 checkpoint, built once per module."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_untokenized_model(arch, tmp_path_factory.mktemp(f"quant-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def float_checkpoint(float_checkpoints):
    """The tiny llama checkpoint."""
    return float_checkpoints("llama")
