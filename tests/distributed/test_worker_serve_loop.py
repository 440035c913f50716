"""The worker process's call loop (runtime.executor.worker_proc.serve) with a step in flight.

A fake socket feeds the calls the executor would broadcast; a fake worker's steps finish only
when the test says so (as a device step does), so the order of launches and answers is visible.
"""

from __future__ import annotations

import pickle

from runtime.executor.worker_proc import serve


class FakeSocket:
    def __init__(self, calls):
        self.incoming = [(b"1", pickle.dumps(call)) for call in calls]
        self.sent = []

    def poll(self, timeout=None):
        return bool(self.incoming)

    def recv_multipart(self):
        return self.incoming.pop(0)

    def send(self, data):
        self.sent.append(pickle.loads(data))


class Step:
    def __init__(self, log, n):
        self.log, self.n, self.done = log, n, False

    def ready(self):
        return self.done

    def result(self):
        self.done = True
        self.log.append(f"answer {self.n}")
        return f"output {self.n}"


class FakeWorker:
    """Steps stay on the 'device' until waited for; another step's launch or a call records itself."""

    def __init__(self):
        self.log, self.steps = [], []

    def launch(self, n):
        if n == "bad":
            raise RuntimeError("cannot launch")
        in_flight = sum(not s.done for s in self.steps)
        assert in_flight <= 1, "at most two steps in flight"
        self.log.append(f"launch {n}")
        self.steps.append(Step(self.log, n))
        return self.steps[-1]

    def describe(self):
        self.log.append("describe")
        return "described"

    def shutdown(self):
        self.log.append("shutdown")


def run(calls):
    worker, sock = FakeWorker(), FakeSocket(calls)
    assert serve(worker, sock, rank=0, parent_pid=None) == 0
    return worker.log, sock.sent


def test_the_next_step_is_launched_before_the_previous_one_is_answered():
    log, sent = run([(1, "execute_model", (1,), {}), (2, "execute_model", (2,), {}), (3, "execute_model", (3,), {}),
                     (4, "shutdown", (), {})])
    assert log == ["launch 1", "launch 2", "answer 1", "launch 3", "answer 2", "answer 3", "shutdown"]
    assert [(seq, ok, out) for seq, _, ok, out in sent] == [(1, True, "output 1"), (2, True, "output 2"),
                                                            (3, True, "output 3"), (4, True, None)]


def test_other_calls_wait_for_the_step_in_flight_and_a_failed_launch_is_reported():
    log, sent = run([(1, "execute_model", (1,), {}), (2, "describe", (), {}), (3, "execute_model", ("bad",), {}),
                     (4, "execute_model", (4,), {}), (5, "shutdown", (), {})])
    assert log == ["launch 1", "answer 1", "describe", "launch 4", "answer 4", "shutdown"]
    by_seq = {seq: (ok, out) for seq, _, ok, out in sent}
    assert by_seq[1] == (True, "output 1") and by_seq[2] == (True, "described") and by_seq[4] == (True, "output 4")
    assert by_seq[3][0] is False and "cannot launch" in by_seq[3][1]
