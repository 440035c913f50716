"""``collective_rpc(timeout_s=...)`` on the one-worker executor: a call that runs past the bound
raises the same ``WorkerDied`` the multiproc executor raises, and later calls wait for the late
one to end (the worker runs one call at a time, as a worker process does)."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.engine_args import EngineArgs
from runtime.executor.broadcast import WorkerDied
from runtime.executor.uniproc import UniProcExecutor
from runtime.testing.models import build_untokenized_model


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    path = build_untokenized_model("llama", tmp_path_factory.mktemp("model") / "llama")
    config = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32").create_engine_config()
    executor = UniProcExecutor(config)
    yield executor
    executor.shutdown()


def test_a_call_past_its_timeout_raises_worker_died(executor):
    release = threading.Event()
    log: list[str] = []

    def slow():
        release.wait(5)
        log.append("slow done")
        return "slow"

    def quick():
        log.append("quick")
        return "quick"

    executor.worker.slow, executor.worker.quick = slow, quick
    started = time.monotonic()
    with pytest.raises(WorkerDied, match="did not answer slow within 0.2 s"):
        executor.collective_rpc("slow", timeout_s=0.2)
    assert time.monotonic() - started < 2.0, "the timeout was not honoured"
    # The late call still runs; a bounded call behind it times out too, without running.
    with pytest.raises(WorkerDied, match="did not answer quick within 0.1 s"):
        executor.collective_rpc("quick", timeout_s=0.1)
    assert log == []
    release.set()
    assert executor.collective_rpc("quick") == ["quick"]  # waits for the late call first
    assert log == ["slow done", "quick"]


def test_results_and_errors_within_the_timeout(executor):
    def fails():
        raise ValueError("bad argument")

    executor.worker.fails = fails
    assert executor.collective_rpc("describe", timeout_s=30) == [executor.worker.describe()]
    with pytest.raises(ValueError, match="bad argument"):
        executor.collective_rpc("fails", timeout_s=30)
    with pytest.raises(ValueError, match="bad argument"):
        executor.collective_rpc("fails")
