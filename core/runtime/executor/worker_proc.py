"""The process of one worker of the ``multiproc`` executor.

It connects a DEALER socket (identity ``rank<N>``) to the executor's ROUTER, builds its
:class:`~runtime.worker.worker.Worker` (joining the process group), says hello, then runs
the calls the executor broadcasts, in order: a reply flag (``b"1"``: answer) and
``(seq, method, args, kwargs)`` pickled, the same bytes for every rank. A call answers
``(seq, rank, ok, result or error text)`` when asked to, and always when it fails. The
process ends on ``shutdown``, or when its parent is gone. :func:`build_and_serve` is the
same loop for a host that is not a child process (a Ray actor); given the executor's
secret, it signs its replies and drops calls not signed with it (:mod:`runtime.executor.signing`).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
import traceback

HELLO_SEQ = -1  # the reply that says the worker is built (or why it could not be)
SHUTDOWN = "shutdown"
EXECUTE_MODEL = "execute_model"
PARENT_POLL_MS = 1000
IN_FLIGHT_POLL_S = 20e-6  # how often a worker with a step on the device looks for its end or the next call

logger = logging.getLogger(__name__)


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
    config, rank: int, init_method: str, address: str, parent_pid: int | None = None, local_rank: int | None = None,
    secret: bytes | None = None,
) -> int:
    """Connect to the executor at ``address``, build the worker (``local_rank``: its device
    index, default ``rank``), say hello, serve the calls; the exit code (0: shut down).
    ``secret``: the executor's, when its socket wants signed messages."""
    import zmq

    from runtime.executor.signing import SignedDealer

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity(rank))
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    if secret is not None:
        sock = SignedDealer(sock, secret)
    try:
        try:
            from runtime.worker.worker import Worker

            worker = Worker(
                config, local_rank=rank if local_rank is None else local_rank, rank=rank, distributed_init_method=init_method
            )
        except BaseException:  # noqa: BLE001 - report why, then exit
            reply(sock, HELLO_SEQ, rank, False, traceback.format_exc())
            return 1
        reply(sock, HELLO_SEQ, rank, True, os.getpid())
        return serve(worker, sock, rank, parent_pid)
    finally:
        sock.close()
        ctx.term()


def serve(worker, sock, rank: int, parent_pid: int | None) -> int:
    """Run calls until ``shutdown`` (exit code 0) or until the parent process is gone (1);
    ``parent_pid`` None: not watched (a cluster's actors end with their owner).

    A step is launched and answered once its sampled tokens are back, but the next step may be
    launched first: with async scheduling the engine sends step N+1 before it waits for step
    N's output, and launching it while N still runs on the device (queued behind it) keeps
    the device busy through the host's work between steps. At most two steps are in flight,
    as the step buffers allow; any other call first waits for the step in flight.
    """
    in_flight = None  # (seq, wants_reply, pending output) of the launched step not answered yet
    while True:
        if in_flight is not None:
            if in_flight[2].ready():  # done (a CPU step is done when launched): answer it first
                _answer(sock, rank, *in_flight)
                in_flight = None
                continue
            if not sock.poll(0):
                time.sleep(IN_FLIGHT_POLL_S)
                continue
        elif not sock.poll(PARENT_POLL_MS):
            if parent_pid is not None and not is_alive(parent_pid):
                logger.warning("the engine process %d is gone; worker %d exits", parent_pid, rank)
                return 1
            continue
        frames = sock.recv_multipart()
        if frames is None:  # not the executor's (a signed socket dropped it)
            continue
        flag, data = frames
        wants_reply = flag == b"1"
        seq, method, args, kwargs = pickle.loads(data)
        if method == EXECUTE_MODEL:
            try:
                launched = (seq, wants_reply, worker.launch(*args, **kwargs))
            except Exception:  # noqa: BLE001 - the executor raises it, naming this rank
                launched = None
                reply(sock, seq, rank, False, traceback.format_exc())
            if in_flight is not None:
                _answer(sock, rank, *in_flight)  # the previous step, now that the next one is queued
            in_flight = launched
            continue
        if in_flight is not None:
            _answer(sock, rank, *in_flight)
            in_flight = None
        if method == SHUTDOWN:
            _shut_down(worker, rank)
            reply(sock, seq, rank, True, None)
            return 0
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the executor raises it, naming this rank
            reply(sock, seq, rank, False, traceback.format_exc())
            continue
        if wants_reply:
            reply(sock, seq, rank, True, result)


def _shut_down(worker, rank: int) -> None:
    """Release the worker and leave the process group; a failure is logged (the process exits
    anyway, and its socket must still be closed)."""
    from runtime.distributed import destroy_distributed

    for release in (worker.shutdown, destroy_distributed):
        try:
            release()
        except Exception:  # noqa: BLE001 - logged; the other release and the exit go on
            logger.exception("worker %d: %s failed during shutdown", rank, getattr(release, "__name__", release))


def _answer(sock, rank: int, seq: int, wants_reply: bool, pending) -> None:
    """Wait for a launched step's output and send it (or its error) if the executor asked for it."""
    try:
        output = pending.result()
    except Exception:  # noqa: BLE001 - the executor raises it, naming this rank
        reply(sock, seq, rank, False, traceback.format_exc())
        return
    if wants_reply:
        reply(sock, seq, rank, True, output)
