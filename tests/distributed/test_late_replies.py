"""Replies that come after their call was given up (timed out, or failed on another rank) are
dropped: never kept, never taken as, or failing, a later call. Workers here are threads that
speak the worker processes' protocol over the executor's real ZMQ socket."""

from __future__ import annotations

import os
import pickle
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from runtime.executor import worker_proc
from runtime.executor.broadcast import BroadcastExecutor, WorkerDied, WorkerSocket

WORLD_SIZE = 2


def serve(address: str, rank: int, behaviour) -> None:
    """One fake worker: hello, then for each call ``behaviour(rank, method, args)`` -> (delay, ok, payload)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_proc.identity(rank))
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    worker_proc.reply(sock, worker_proc.HELLO_SEQ, rank, True, os.getpid())
    while True:
        _flag, data = sock.recv_multipart()
        seq, method, args, _kwargs = pickle.loads(data)
        if method == worker_proc.SHUTDOWN:
            break
        delay, ok, payload = behaviour(rank, method, args)
        time.sleep(delay)
        worker_proc.reply(sock, seq, rank, ok, payload)
    sock.close()
    ctx.term()


class ThreadWorkers:
    """A :class:`runtime.executor.broadcast.WorkerGroup` of threads."""

    def __init__(self, behaviour):
        self.closed = False
        self.socket = WorkerSocket("tcp://127.0.0.1:0")
        self.threads = [threading.Thread(target=serve, args=(self.socket.address, rank, behaviour), daemon=True)
                        for rank in range(WORLD_SIZE)]
        for thread in self.threads:
            thread.start()

    def dead_worker(self):
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.socket.send_shutdown(range(WORLD_SIZE))
        for thread in self.threads:
            thread.join(5)
        self.socket.close()


def behaviour(rank: int, method: str, args: tuple):
    """``echo``: the argument back; rank 1 answers ``slow`` after 0.5 s; ``slow_error`` fails late on rank 1."""
    if method == "slow" and rank == 1:
        return 0.5, True, ("slow", rank, args)
    if method == "slow_error" and rank == 1:
        return 0.5, False, "Traceback: rank 1 failed late"
    return 0.0, True, (method, rank, args)


@pytest.fixture
def executor():
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=WORLD_SIZE, tensor_parallel_size=WORLD_SIZE),
                             cache_config=SimpleNamespace(kv_connector=None))
    executor = BroadcastExecutor(config)
    executor.start(ThreadWorkers(behaviour), timeout_s=30)
    yield executor
    executor.shutdown()


def wait_for_late_replies(executor) -> None:
    """Let the slow rank answer, and let the executor read it (an answered call reads all that waits)."""
    time.sleep(0.8)
    assert executor.collective_rpc("echo", ("flush",)) == [("echo", 0, ("flush",)), ("echo", 1, ("flush",))]


def test_replies_after_a_timeout_are_dropped(executor):
    with pytest.raises(WorkerDied, match="did not answer slow within 0.2 s"):
        executor.collective_rpc("slow", ("first",), timeout_s=0.2)
    wait_for_late_replies(executor)
    assert executor._results == {}, "replies of the timed-out call are still held"
    assert executor.collective_rpc("echo", ("second",)) == [("echo", 0, ("second",)), ("echo", 1, ("second",))]


def test_an_error_after_a_timeout_does_not_fail_the_next_call(executor):
    with pytest.raises(WorkerDied, match="did not answer slow_error within 0.2 s"):
        executor.collective_rpc("slow_error", timeout_s=0.2)
    time.sleep(0.8)
    assert executor.collective_rpc("echo", ("next",)) == [("echo", 0, ("next",)), ("echo", 1, ("next",))]
    assert executor._results == {}


def test_waiting_again_for_a_step_given_up_raises_at_once(executor):
    """A step whose wait failed (here: timed out) raises again at once when asked for its result a second time,
    rather than waiting for replies that were dropped."""
    seq = executor._broadcast("slow", ("step",), {}, reply_ranks={0, 1})
    with pytest.raises(WorkerDied, match="did not answer slow within 0.2 s"):
        executor._wait(seq, [0, 1], "slow", timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(WorkerDied, match="slow failed already; its replies were dropped"):
        executor._wait(seq, [0, 1], "slow", timeout_s=2)  # (without the check: "did not answer" after 2 s)
    assert time.monotonic() - started < 0.1
    wait_for_late_replies(executor)
