"""Fixtures of the server tests: a tiny model with clear greedy picks."""

from __future__ import annotations

import pytest

from support.remote_server import sharpen


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from runtime.testing.models import build_tiny_model

    path = build_tiny_model("llama", tmp_path_factory.mktemp("serve_llama"))
    sharpen(path)
    return path
