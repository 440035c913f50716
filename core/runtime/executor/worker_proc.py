"""The process of one worker of the ``multiproc`` executor.

It connects a DEALER socket (identity ``rank<N>``) to the executor's ROUTER, builds its
:class:`~runtime.worker.worker.Worker` (joining the process group), says hello, then runs
the calls the executor broadcasts, in order: a reply flag (``b"1"``: answer) and
``(seq, method, args, kwargs)`` pickled, the same bytes for every rank. A call answers
``(seq, rank, ok, result or error text)`` when asked to, and always when it fails. The
process ends on ``shutdown``, or when its parent is gone. :func:`build_and_serve` is the
same loop for a host that is not a child process (a Ray actor).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback

HELLO_SEQ = -1  # the reply that says the worker is built (or why it could not be)
SHUTDOWN = "shutdown"
PARENT_POLL_MS = 1000


def identity(rank: int) -> bytes:
    return f"rank{rank}".encode()


def reply(sock, seq: int, rank: int, ok: bool, payload) -> None:
    try:
        data = pickle.dumps((seq, rank, ok, payload), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - a result that does not pickle is this call's error
        data = pickle.dumps((seq, rank, False, f"the result of call {seq} cannot be sent: {exc!r}"))
    sock.send(data)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_worker(config, rank: int, init_method: str, address: str, parent_pid: int, environ: dict[str, str] | None = None) -> None:
    """Process entry point: build the worker, then serve the executor's calls.

    ``environ`` is the starting process's environment: a worker forked from the fork server
    would otherwise see the server's, as it was when the process's first engine started it.
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [worker {rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when to stop
    sys.exit(build_and_serve(config, rank, init_method, address, parent_pid))


def build_and_serve(
    config, rank: int, init_method: str, address: str, parent_pid: int | None = None, local_rank: int | None = None
) -> int:
    """Connect to the executor at ``address``, build the worker (``local_rank``: its device
    index, default ``rank``), say hello, serve the calls; the exit code (0: shut down)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity(rank))
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    try:
        from runtime.worker.worker import Worker

        worker = Worker(
            config, local_rank=rank if local_rank is None else local_rank, rank=rank, distributed_init_method=init_method
        )
    except BaseException:  # noqa: BLE001 - report why, then exit
        reply(sock, HELLO_SEQ, rank, False, traceback.format_exc())
        exit_code = 1
    else:
        reply(sock, HELLO_SEQ, rank, True, os.getpid())
        exit_code = serve(worker, sock, rank, parent_pid)
    sock.close()
    ctx.term()
    return exit_code


def serve(worker, sock, rank: int, parent_pid: int | None) -> int:
    """Run calls until ``shutdown`` (exit code 0) or until the parent process is gone (1);
    ``parent_pid`` None: not watched (a cluster's actors end with their owner)."""
    while True:
        if not sock.poll(PARENT_POLL_MS):
            if parent_pid is not None and not is_alive(parent_pid):
                logging.getLogger(__name__).warning("the engine process %d is gone; worker %d exits", parent_pid, rank)
                return 1
            continue
        flag, data = sock.recv_multipart()
        wants_reply = flag == b"1"
        seq, method, args, kwargs = pickle.loads(data)
        if method == SHUTDOWN:
            try:
                worker.shutdown()
            finally:
                from runtime.distributed import destroy_distributed

                destroy_distributed()
            reply(sock, seq, rank, True, None)
            return 0
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the executor raises it, naming this rank
            reply(sock, seq, rank, False, traceback.format_exc())
            continue
        if wants_reply:
            reply(sock, seq, rank, True, result)
