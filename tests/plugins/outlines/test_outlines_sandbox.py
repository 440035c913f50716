"""The outlines backend compiles in the engine's grammar sandbox.

A spec whose automaton outgrows the memory limit (``a{99999999}``: outlines-core asks for 1 GiB at
once) or whose compile outlasts the time limit (``[a-z]{20000}``: ~30 s and ~3 GB) fails its
request alone, with a message naming the limit; the engine process does not grow, no compile keeps
running, and the next spec compiles. Grammars from the sandbox allow exactly what in-process ones do.
"""

from __future__ import annotations

import json
import resource
import time

import pytest
import torch

from runtime.scheduler import structured_output
from runtime.scheduler.structured_output import StructuredOutputManager
from runtime.structured_output import GuidedKind, IsolatedCompileBackend, allocate_token_bitmask

GIB = 1 << 30
SMOLLM2_VOCAB_SIZE = 49152  # the model's logits width


@pytest.fixture
def make_manager(smollm2_backend):
    managers = []

    def make(timeout: float = 60.0, memory: int = GIB) -> StructuredOutputManager:
        managers.append(StructuredOutputManager(lambda: smollm2_backend, SMOLLM2_VOCAB_SIZE, timeout, memory))
        return managers[-1]

    yield make
    for manager in managers:
        manager.shutdown()


def compile_now(manager: StructuredOutputManager, kind: str, spec: str):
    """The request's grammar once compiled, or the ValueError its request fails with."""
    request = manager.submit(kind, spec)
    while True:
        try:
            if manager.poll(request):
                return request.grammar
        except ValueError as exc:
            return exc
        manager.wait([request], 0.5)


def allowed(grammar) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, SMOLLM2_VOCAB_SIZE)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask


def test_outlines_compiles_in_the_sandbox(smollm2_backend, make_manager):
    assert isinstance(smollm2_backend, IsolatedCompileBackend)
    manager = make_manager()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 12}},
                         "required": ["n"]})
    for kind, spec in [("json", schema), ("regex", "[a-c]{2,4}"), ("choice", json.dumps(["yes", "no"]))]:
        isolated, local = compile_now(manager, kind, spec), smollm2_backend.compile(GuidedKind(kind), spec)
        assert not isinstance(isolated, Exception), isolated
        text = {"json": '{"n": 12}', "regex": "abca", "choice": "yes"}[kind]
        ids = smollm2_backend.tokenizer.encode(text, add_special_tokens=False)
        for token in ids:  # walk both over the same tokens, comparing every bitmask
            assert torch.equal(allowed(isolated), allowed(local))
            assert isolated.accept_tokens([token]) and local.accept_tokens([token])
        assert torch.equal(allowed(isolated), allowed(local)) and isolated.is_terminated() == local.is_terminated()
    assert manager._sandbox.num_processes == 1


def test_a_spec_past_the_memory_limit_fails_alone(make_manager):
    manager = make_manager(memory=GIB // 2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = compile_now(manager, "regex", "a{99999999}")
    assert isinstance(error, ValueError)
    assert "needed more than 0.5 GiB of memory (structured_output_compile_memory_bytes)" in str(error)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: the engine did not grow
    assert not isinstance(compile_now(manager, "regex", "[0-9]{3}"), Exception)


def test_a_spec_past_the_time_limit_is_stopped(make_manager):
    manager = make_manager(timeout=1.5, memory=8 * GIB)
    start = time.monotonic()
    error = compile_now(manager, "regex", "[a-z]{20000}")
    assert isinstance(error, ValueError) and "took longer than 1.5 s (structured_output_compile_timeout)" in str(error)
    assert time.monotonic() - start < 15
    deadline = time.monotonic() + 10
    while manager._sandbox.num_processes and time.monotonic() < deadline:  # killed at its deadline, not left running
        time.sleep(0.05)
    assert manager._sandbox.num_processes == 0
    assert not isinstance(compile_now(manager, "regex", "[0-9]{3}"), Exception)
    # A timed-out spec is not remembered as bad (it may compile on a less loaded machine): it compiles again.
    # (Its compile was dropped from the cache when its only request gave up, or it ended there as a timeout.)
    failed = manager._cache.get(("regex", "[a-z]{20000}"))
    assert failed is None or isinstance(failed.exception(), TimeoutError)
    again = manager.submit("regex", "[a-z]{20000}")
    assert again.future is not failed and manager._cache[("regex", "[a-z]{20000}")] is again.future


def test_bad_specs_name_the_problem_and_are_remembered(make_manager):
    manager = make_manager()
    error = compile_now(manager, "regex", "(a")
    assert isinstance(error, ValueError) and "the regex '(a' cannot be compiled" in str(error)
    assert ("regex", "(a") in manager._cache


def test_the_cache_is_bounded_by_bytes(make_manager, monkeypatch):
    manager = make_manager()
    first = compile_now(manager, "regex", "[a-z]{1,30}")
    size = manager._cache[("regex", "[a-z]{1,30}")].result()[1]
    assert not isinstance(first, Exception) and size > 1000
    monkeypatch.setattr(structured_output, "CACHE_BYTES", int(size * structured_output.LOADED_PER_PICKLED) + 100)
    compile_now(manager, "regex", "[0-9]{1,30}")
    compile_now(manager, "regex", "[x-z]{2}")  # the submit that finds the first two over the budget drops the oldest
    assert ("regex", "[a-z]{1,30}") not in manager._cache and ("regex", "[x-z]{2}") in manager._cache
