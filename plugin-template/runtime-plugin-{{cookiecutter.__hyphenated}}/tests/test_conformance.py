"""The runtime's conformance kit against this plugin's backend on the cpu platform: greedy
tokens equal to transformers' for every architecture, with prefix caching, chunked prefill,
preemption and async scheduling (``runtime.testing.conformance``)."""

import pytest

from runtime.testing.conformance import *  # noqa: F401,F403
from runtime.testing.plugin import ConformanceTarget


@pytest.fixture(scope="session")
def conformance_target() -> ConformanceTarget:
    return ConformanceTarget("cpu", "{{ cookiecutter.__underscored }}_sdpa")
