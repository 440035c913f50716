"""A worker process whose ``Worker.shutdown`` raises still answers the shutdown call, closes its
socket and exits 0, with the error in its log (runtime.executor.worker_proc.build_and_serve)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from runtime.executor import worker_proc
from runtime.executor.broadcast import WorkerSocket

# A worker process as the multiproc executor starts one, with a Worker whose release fails.
WORKER = """
import logging, sys
import runtime.worker.worker as worker_module

class BrokenRelease:
    def __init__(self, config, **kwargs):
        pass

    def shutdown(self):
        raise RuntimeError("the device would not let go")

worker_module.Worker = BrokenRelease
logging.basicConfig(level=logging.INFO)
from runtime.executor.worker_proc import build_and_serve
sys.exit(build_and_serve(None, 0, "unused", sys.argv[1], parent_pid=None))
"""


def test_a_failing_worker_shutdown_is_logged_and_the_process_exits_cleanly(tmp_path):
    socket = WorkerSocket(f"ipc://{tmp_path}/workers")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, socket.address], stderr=subprocess.PIPE, text=True)
    try:
        assert socket.sock.poll(120_000), "no hello from the worker"
        assert pickle.loads(socket.recv())[:3] == (worker_proc.HELLO_SEQ, 0, True)
        socket.send(0, pickle.dumps((1, worker_proc.SHUTDOWN, (), {})), wants_reply=True)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert "worker 0: shutdown failed during shutdown" in stderr and "the device would not let go" in stderr, stderr
        # The shutdown call was still answered before the socket closed.
        assert socket.sock.poll(5000) and pickle.loads(socket.recv()) == (1, 0, True, None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        socket.close()
