"""A worker process that cannot be started (here: the second start fails, as a fork can under
memory pressure) stops the ranks already started and removes the socket folder before the error
goes up, rather than leaving a rank waiting for its missing peer."""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from types import SimpleNamespace

import pytest

from runtime.executor import multiproc


class FailingSecondStart:
    """A start-method context whose first Process is a real (sleeping) child and whose second start fails."""

    def __init__(self):
        self.started = []

    def Process(self, target, args, name, daemon):  # noqa: N802 - the multiprocessing context's spelling
        if self.started:
            return SimpleNamespace(start=self._fail)
        process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), name=name, daemon=daemon)
        self.started.append(process)
        return process

    @staticmethod
    def _fail():
        raise OSError("fork failed: Cannot allocate memory")


def test_a_failed_start_stops_the_started_ranks_and_cleans_up(monkeypatch, tmp_path):
    context = FailingSecondStart()
    monkeypatch.setattr(multiproc, "worker_context", lambda: context)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(OSError, match="fork failed"):
        multiproc.WorkerProcesses(config=None, world_size=2)
    assert len(context.started) == 1
    rank0 = context.started[0]
    assert not rank0.is_alive(), "rank 0 outlived the failed start"
    assert rank0.exitcode is not None
    assert list(tmp_path.glob("runtime-mp-*")) == [], "the socket folder was left behind"
