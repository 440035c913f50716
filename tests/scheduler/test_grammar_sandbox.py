"""The grammar sandbox: compiles in child processes under a memory limit, killed at their deadline.

Real child processes run a scripted compiler (tests/support/sandbox_compilers.py): results and bad
specs come back as they were raised, a compile that runs out of its memory (Python's MemoryError,
or a native allocator's abort) or past its deadline fails alone, its process is replaced, and the
next compile works; concurrent compiles get their own processes; the limit counts only what a
compile adds to the loaded compiler.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

from runtime.scheduler.grammar_sandbox import CompileFailed, CompileOutOfMemory, CompileTimeout, GrammarSandbox
from support.sandbox_compilers import ScriptedCompiler

MIB = 1 << 20


@pytest.fixture
def sandbox():
    box = GrammarSandbox(ScriptedCompiler(), 64 * MIB)
    yield box
    box.close()


def later(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_and_errors_come_back_from_one_reused_process(sandbox):
    (kind, argument, pid), size = sandbox.compile("regex", "echo:abc", later())
    assert (kind, argument) == ("regex", "abc") and pid != os.getpid() and size > 0
    with pytest.raises(ValueError, match="bad spec x") as bad:
        sandbox.compile("json", "invalid:x", later())
    assert not isinstance(bad.value, CompileOutOfMemory)
    with pytest.raises(CompileFailed, match="KeyError: 'k'"):
        sandbox.compile("json", "error:k", later())
    with pytest.raises(CompileFailed, match="Panic: rust said no"):
        sandbox.compile("json", "panic:rust said no", later())
    assert sandbox.compile("regex", "echo:again", later())[0][2] == pid  # the same child served them all
    assert sandbox.num_processes == 1


@pytest.mark.parametrize("action", ["grow:", "abort:"])
def test_a_compile_out_of_memory_fails_alone(sandbox, action):
    with pytest.raises(CompileOutOfMemory, match=r"compiling this regex needed more than 0.0625 GiB of memory "
                                                 r"\(structured_output_compile_memory_bytes\)"):
        sandbox.compile("regex", action, later())
    assert sandbox.compile("regex", "echo:after", later())[0][1] == "after"


def test_a_process_that_exits_is_a_failure_not_a_memory_error(sandbox):
    with pytest.raises(CompileFailed, match="exited with status 3"):
        sandbox.compile("regex", "exit:3", later())
    assert sandbox.compile("regex", "echo:after", later())[0][1] == "after"


def test_a_compile_past_its_deadline_is_killed(sandbox):
    pid = sandbox.compile("regex", "echo:", later())[0][2]
    start = time.monotonic()
    with pytest.raises(CompileTimeout):
        sandbox.compile("regex", "sleep:60", start + 0.5)
    assert 0.5 <= time.monotonic() - start < 10
    assert not alive(pid) and sandbox.num_processes == 0  # killed and reaped: no zombie holds its memory
    assert sandbox.compile("regex", "echo:after", later())[0][2] != pid


def test_concurrent_compiles_run_in_their_own_processes(sandbox):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pids = list(pool.map(lambda _: sandbox.compile("regex", "sleep:1", later())[0], range(2)))
    assert len(set(pids)) == 2 and sandbox.num_processes == 2


def test_the_limit_counts_what_a_compile_adds():
    """A compiler holding 96 MiB loads under a 64 MiB limit, and its compiles may still add up to 64 MiB."""
    box = GrammarSandbox(ScriptedCompiler(ballast=96 * MIB), 64 * MIB)
    try:
        artifact, size = box.compile("regex", "big:16", later())
        assert len(artifact) == 16 * MIB and size > 16 * MIB
        with pytest.raises(CompileOutOfMemory):
            box.compile("regex", "big:80", later())
    finally:
        box.close()


def test_close_kills_the_processes_and_refuses_more(sandbox):
    pid = sandbox.compile("regex", "echo:", later())[0][2]
    sandbox.close()
    assert not alive(pid) and sandbox.num_processes == 0
    with pytest.raises(CompileFailed, match="shut down"):
        sandbox.compile("regex", "echo:", later())


def test_a_child_exits_when_its_parent_goes(sandbox):
    sandbox.compile("regex", "echo:", later())
    (child,) = sandbox._idle
    child.process.stdin.close()  # what the parent's death does to the pipe
    assert child.process.wait(timeout=30) == 0


def test_a_compiler_the_child_cannot_load_fails_each_compile_clearly():
    """A compiler whose module the child cannot import (here one that exists only in this process)."""
    import sys
    import types

    module = types.ModuleType("ghost_compilers")
    exec("class Ghost:\n    def __call__(self, kind, spec):\n        return spec\n", module.__dict__)
    sys.modules["ghost_compilers"] = module
    try:
        box = GrammarSandbox(module.Ghost(), 64 * MIB)
    finally:
        del sys.modules["ghost_compilers"]
    try:
        for _ in range(2):
            with pytest.raises(CompileFailed, match="grammar compile process (exited with|ended as it started).* status 1"):
                box.compile("regex", "x", later())
        assert box.num_processes == 0
    finally:
        box.close()


def test_a_cancelled_compile_is_killed_and_the_next_one_works(sandbox):
    """CompileHandle.cancel from another thread kills the child running the compile (the call raises
    CompileCancelled at once, not at its deadline); a handle cancelled before its compile starts stops it there."""
    from runtime.scheduler.grammar_sandbox import CompileCancelled, CompileHandle

    handle = CompileHandle()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(sandbox.compile, "regex", "sleep:60", later(), handle)
        deadline = time.monotonic() + 30
        while handle._child is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = handle._child.process.pid
        start = time.monotonic()
        handle.cancel()
        with pytest.raises(CompileCancelled):
            running.result(timeout=10)
        assert time.monotonic() - start < 5 and not alive(pid) and sandbox.num_processes == 0
    early = CompileHandle()
    early.cancel()
    with pytest.raises(CompileCancelled):
        sandbox.compile("regex", "echo:never", later(), early)
    assert sandbox.compile("regex", "echo:next", later())[0][1] == "next"
