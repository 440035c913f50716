"""Collected by ``pytest -p runtime.testing.plugin --pyargs runtime.testing``: the conformance suite."""

from runtime.testing.conformance import *  # noqa: F401,F403
