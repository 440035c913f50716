"""The conformance kit (runtime.testing) on the CPU: the cpu platform with its own
``cpu_paged`` backend and with core's reference ``sdpa`` backend."""

import pytest

from runtime.testing.conformance import *  # noqa: F401,F403
from runtime.testing.plugin import ConformanceTarget


@pytest.fixture(scope="session", params=["cpu_paged", "sdpa"])
def conformance_target(request) -> ConformanceTarget:
    return ConformanceTarget("cpu", request.param)
