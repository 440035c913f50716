"""The structured output manager drops a compile that no request waits for any more: queued, it is taken off the
queue; running in the grammar sandbox, its child process is killed. So clients that send slow specs and hang up do
not hold the compile workers that other clients' grammars need (fuzzed, session 33: six aborted slow regexes made a
trivial one from another client fail after 64 s). A request that waits its whole time limit in the queue is told so.
Real child processes run the scripted compiler of tests/support/sandbox_compilers.py."""

from __future__ import annotations

import time

import pytest

from runtime.scheduler.grammar_sandbox import CompileCancelled
from runtime.scheduler.structured_output import NUM_COMPILE_THREADS, StructuredOutputManager
from support.sandbox_compilers import ScriptedCompiler


class _Grammar:
    def __init__(self, artifact):
        self.artifact = artifact

    def fork(self):
        return _Grammar(self.artifact)


class ScriptedBackend:
    """A guided backend whose compiles run in the sandbox (the optional IsolatedCompileBackend contract)."""

    def isolated_compiler(self):
        return ScriptedCompiler()

    def load_compiled(self, kind, spec, artifact):
        return _Grammar(artifact)

    def compile(self, kind, spec):
        return _Grammar(ScriptedCompiler()(kind.value, spec))


@pytest.fixture
def manager():
    made = StructuredOutputManager(ScriptedBackend, vocab_size=8, compile_timeout=60.0, compile_memory=256 << 20)
    yield made
    made.shutdown()


def until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def ready(manager, request, seconds: float = 30.0) -> bool:
    return until(lambda: manager.poll(request), seconds)


def test_compiles_nobody_waits_for_are_dropped_and_others_compile_at_once(manager):
    slow = [manager.submit("regex", f"sleep:60.{i}") for i in range(NUM_COMPILE_THREADS + 1)]
    assert until(lambda: manager._sandbox is not None and manager._sandbox.num_processes == NUM_COMPILE_THREADS)
    running, queued = slow[:NUM_COMPILE_THREADS], slow[NUM_COMPILE_THREADS]
    assert all(r.future.running() for r in running) and not queued.future.running()
    start = time.monotonic()
    for request in slow:  # their clients hung up
        manager.release(request)
    assert queued.future.cancelled()
    assert until(lambda: all(r.future.done() for r in running), 10)
    assert all(isinstance(r.future.exception(), CompileCancelled) for r in running)
    assert until(lambda: manager._sandbox.num_processes == 0, 10)
    assert not any(("regex", f"sleep:60.{i}") in manager._cache for i in range(len(slow)))
    other = manager.submit("regex", "echo:fast")
    assert ready(manager, other, 20) and time.monotonic() - start < 20
    assert other.grammar.artifact[1] == "fast"
    again = manager.submit("regex", "sleep:60.0")  # asked for again: compiled afresh, not the cancelled one
    assert again.future is not running[0].future and not again.future.done()
    manager.release(again)


def test_a_compile_another_request_still_waits_for_goes_on(manager):
    first, second = manager.submit("regex", "sleep:2"), manager.submit("regex", "sleep:2")
    assert first.future is second.future
    manager.release(first)
    assert not first.future.cancelled()
    assert ready(manager, second) and second.grammar.artifact > 0  # the child's pid: it ran to the end


def test_a_request_that_waited_its_whole_limit_in_the_queue_is_told_so(manager):
    busy = [manager.submit("regex", f"sleep:30.{i}") for i in range(NUM_COMPILE_THREADS)]
    assert until(lambda: all(r.future.running() for r in busy))
    manager.compile_timeout = 1.0  # for the request that comes now; the running compiles keep their 60 s
    queued = manager.submit("regex", "echo:late")
    time.sleep(1.2)
    with pytest.raises(ValueError, match=r"the regex grammar waited 1 s \(structured_output_compile_timeout\) for a "
                                         r"compile worker, all busy with other requests' grammars; retry later"):
        manager.poll(queued)
    assert queued.future.cancelled()  # nobody else waited for it: off the queue
    for request in busy:
        manager.release(request)
    assert until(lambda: manager._sandbox.num_processes == 0, 10)
