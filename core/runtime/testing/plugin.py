"""pytest plugin of the conformance kit: which platform and attention backend to check.

Load it with ``-p runtime.testing.plugin`` (or ``pytest_plugins = ["runtime.testing.plugin"]``
in a root conftest). A plugin's own tests may instead override the ``conformance_target``
fixture to pin their platform and backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class ConformanceTarget:
    """The platform and attention backend under test (None: the engine's default choice)."""

    platform: str | None = None
    attention_backend: str | None = None
    kv_cache_memory_bytes: int | None = None  # None: the platform sizes the KV cache (a GPU: 90 % of its memory)

    def engine_args(self) -> dict:
        args = {}
        if self.platform:
            args["platform"] = self.platform
        if self.attention_backend:
            args["attention_backend"] = self.attention_backend
        if self.kv_cache_memory_bytes:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return args

    def __str__(self) -> str:
        return f"{self.platform or 'default platform'}/{self.attention_backend or 'default backend'}"


def pytest_addoption(parser):
    group = parser.getgroup("runtime conformance")
    group.addoption("--platform", default=None, help="platform to run the conformance suite on (default: auto)")
    group.addoption("--attention-backend", default=None, help="attention backend to check (default: the platform's)")
    group.addoption("--kv-cache-memory-bytes", type=int, default=None,
                    help="KV cache size of each engine (default: the platform's sizing); lets several runs share a GPU")


@pytest.fixture(scope="session")
def conformance_target(request) -> ConformanceTarget:
    option = request.config.getoption
    return ConformanceTarget(option("--platform"), option("--attention-backend"), option("--kv-cache-memory-bytes"))
