"""Fixtures of the server tests: a tiny model with clear greedy picks."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from remote_server import sharpen  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tiny_models import build_tiny_model

    path = build_tiny_model("llama", tmp_path_factory.mktemp("serve_llama"))
    sharpen(path)
    return path
