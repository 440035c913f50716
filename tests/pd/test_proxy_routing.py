"""``runtime proxy --routing``: which prefill or decode instance a request goes to. By load, the
instance with the fewest requests this proxy has in flight to it (ties in turn); in turn, each
instance after the other whatever its load. A request gives its instance back when it ends."""

from __future__ import annotations

import pytest

from runtime.cli.proxy import ROUTINGS as CLI_ROUTINGS
from runtime.entrypoints.proxy import ROUTINGS, Backends

P, D = ["http://p0", "http://p1/"], ["http://d0", "http://d1", "http://d2"]


def test_least_requests_takes_the_least_loaded_and_turns_on_ties():
    backends = Backends(P, D)
    assert backends.routing == "least_requests"
    first = [backends.take("decode") for _ in range(3)]
    assert sorted(first) == ["http://d0", "http://d1", "http://d2"]  # one each before any gets a second
    backends.give_back("decode", "http://d1")
    assert backends.take("decode") == "http://d1"  # the only one with nothing in flight
    assert backends.in_flight["decode"] == {"http://d0": 1, "http://d1": 1, "http://d2": 1}
    for url in ("http://d0", "http://d1", "http://d2"):
        backends.give_back("decode", url)
    assert {backends.take("prefill"), backends.take("prefill")} == {"http://p0", "http://p1"}  # trailing "/" dropped


def test_round_robin_ignores_load():
    backends = Backends(P, D, "round_robin")
    assert [backends.take("decode") for _ in range(4)] == ["http://d0", "http://d1", "http://d2", "http://d0"]
    assert backends.in_flight["decode"]["http://d0"] == 2


def test_bad_routing_and_empty_pools_are_errors():
    assert CLI_ROUTINGS == ROUTINGS
    with pytest.raises(ValueError, match=r"routing 'random' is not supported; choose one of: least_requests, round_robin"):
        Backends(P, D, "random")
    with pytest.raises(ValueError, match="at least one --prefill URL and one --decode URL"):
        Backends([], D)
