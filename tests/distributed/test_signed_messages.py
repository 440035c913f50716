"""Signed executor <-> worker messages (runtime.executor.signing), as the ``ray`` executor's TCP
socket uses them: a message from anyone without the secret is dropped before it is unpickled,
on either side, and the signed calls and replies still go through."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from types import SimpleNamespace

import zmq

from runtime.executor import signing, worker_proc
from runtime.executor.broadcast import BroadcastExecutor, WorkerSocket

FORGED_LOG = "does not carry this executor's signature"


class Exploit:
    """Unpickling it creates ``path``: the proof that forged bytes were unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class FakeWorker:
    def describe(self):
        return "described"

    def shutdown(self):
        pass


def forged_frames(marker, secret: bytes, kind: bytes, frames: list) -> list[list]:
    """The same evil pickle unsigned, with a MAC of the wrong length, and signed with another secret."""
    evil = pickle.dumps(Exploit(marker))
    return [
        frames + [evil],
        frames + [evil, b"not a mac"],
        frames + [evil, signing.mac(signing.new_secret(), kind, *frames, evil)],
    ]


class ThreadWorkers:
    """A WorkerGroup whose one rank is a thread serving a FakeWorker over a signed DEALER."""

    def __init__(self, socket: WorkerSocket):
        self.socket, self.closed = socket, False
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, worker_proc.identity(0))
        self.dealer.connect(socket.address)
        signed = signing.SignedDealer(self.dealer, socket.secret)
        self.exit_codes = []

        def run():
            worker_proc.reply(signed, worker_proc.HELLO_SEQ, 0, True, os.getpid())
            self.exit_codes.append(worker_proc.serve(FakeWorker(), signed, 0, None))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def dead_worker(self):
        return None if self.thread.is_alive() or not self.exit_codes else "worker rank 0 ended"

    def close(self):
        if not self.closed:
            self.closed = True
            self.socket.send_shutdown([0])
            self.thread.join(10)
            self.dealer.close(linger=0)
            self.ctx.term()
            self.socket.close()


def one_rank_config():
    parallel = SimpleNamespace(world_size=1, tensor_parallel_size=1)
    return SimpleNamespace(parallel_config=parallel, cache_config=SimpleNamespace(kv_connector=None))


def test_the_executor_drops_replies_that_are_not_signed_with_its_secret(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=signing.__name__)
    marker = tmp_path / "pwned"
    socket = WorkerSocket("tcp://127.0.0.1:0", secret=signing.new_secret())
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)  # any host that reaches the port
    intruder.connect(socket.address)
    for frames in forged_frames(marker, socket.secret, signing.REPLY, []):
        intruder.send_multipart(frames)
    executor = BroadcastExecutor(one_rank_config())
    executor.start(ThreadWorkers(socket), timeout_s=10)
    try:
        assert executor.worker_pids == [os.getpid()]
        # Calls go on until every forged message has been read (and dropped).
        for _ in range(200):
            assert executor.collective_rpc("describe", timeout_s=10) == ["described"]
            if sum(FORGED_LOG in r.getMessage() for r in caplog.records) == 3:
                break
        assert sum(FORGED_LOG in r.getMessage() for r in caplog.records) == 3, caplog.text
        assert not marker.exists(), "a forged message was unpickled by the executor"
    finally:
        executor.shutdown()
        intruder.close(linger=0)
        ctx.term()
    assert executor.workers.exit_codes == [0]


def test_a_worker_drops_calls_that_are_not_signed_with_the_secret(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=signing.__name__)
    marker = tmp_path / "pwned"
    secret = signing.new_secret()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # stands in for whoever holds the executor's address
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, worker_proc.identity(0))
    dealer.connect(f"tcp://127.0.0.1:{port}")
    worker_sock = signing.SignedDealer(dealer, secret)
    try:
        worker_proc.reply(worker_sock, worker_proc.HELLO_SEQ, 0, True, 1)
        assert router.poll(10_000)
        identity, *hello = router.recv_multipart()
        assert pickle.loads(signing.checked(secret, signing.REPLY, hello, 1, "test")[0]) == (-1, 0, True, 1)
        for frames in forged_frames(marker, secret, signing.CALL, [b"1"]):
            router.send_multipart([identity, *frames])
        for seq, method in [(1, "describe"), (2, worker_proc.SHUTDOWN)]:
            call = pickle.dumps((seq, method, (), {}))
            router.send_multipart([identity, b"1", call, signing.mac(secret, signing.CALL, b"1", call)])
        assert worker_proc.serve(FakeWorker(), worker_sock, 0, None) == 0
        replies = []
        while router.poll(1000):
            frames = router.recv_multipart()[1:]
            replies.append(pickle.loads(signing.checked(secret, signing.REPLY, frames, 1, "test")[0]))
        assert replies == [(1, 0, True, "described"), (2, 0, True, None)]
        assert not marker.exists(), "a forged call was unpickled by the worker"
        assert sum(FORGED_LOG in r.getMessage() for r in caplog.records) == 3, caplog.text
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
