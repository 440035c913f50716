"""The part of a many-worker executor that does not care where the workers run.

Each call (``execute_model`` or any ``collective_rpc``) is pickled once and the same bytes
go to every rank over a ZMQ ROUTER socket (one DEALER per worker, identity ``rank<N>``);
the workers run it together (their collectives go through the platform's process group)
and the ranks asked to answer reply ``(seq, rank, ok, result or error text)``. On a socket
that other hosts can reach, a secret signs every message both ways
(:mod:`runtime.executor.signing`): nothing unsigned is unpickled. While
waiting, the executor asks its :class:`WorkerGroup` whether a worker died: a dead worker,
or a call that fails on any rank, raises :class:`WorkerDied` naming the rank within a poll
interval, never a hang.

A :class:`WorkerGroup` says how workers start, are watched and stop: local processes
(:mod:`runtime.executor.multiproc`) or actors of a cluster (``runtime-plugin-ray``).
"""

from __future__ import annotations

import logging
import pickle
import time
import weakref
from typing import Any, Protocol

import zmq

from runtime.config import EngineConfig
from runtime.executor import signing, worker_proc
from runtime.messages import ModelRunnerOutput, SchedulerOutput
from runtime.structured_output import resolve_bitmask

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait looks at the workers
STARTUP_TIMEOUT_S = 600.0
DEATH_GRACE_S = 1.0  # after a rank's error, how long to look for a dead peer that caused it


class WorkerDied(RuntimeError):
    """A worker exited or a call failed on a worker; the message names the rank."""


class WorkerSocket:
    """The executor's ROUTER socket: sends a call to one rank, receives the ranks' replies."""

    def __init__(self, address: str, secret: bytes | None = None):
        """``address``: ``ipc://path`` or ``tcp://host:port`` (port 0 or ``*``: any free port);
        ``secret``: sign the calls and accept only replies signed with it (the workers get it too)."""
        self.secret = secret
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a worker that is gone raises
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port chosen, for the workers

    def send(self, rank: int, data: bytes, wants_reply: bool) -> bool:
        flag = b"1" if wants_reply else b"0"
        frames = [worker_proc.identity(rank), flag, data]
        if self.secret is not None:
            frames.append(signing.mac(self.secret, signing.CALL, flag, data))
        try:
            self.sock.send_multipart(frames, copy=False)
            return True
        except zmq.ZMQError:  # the worker's socket is gone (it died): the wait reports it
            return False

    def recv(self) -> bytes | None:
        """One worker's pickled reply, or None for a message that is not one (dropped, warned)."""
        frames = self.sock.recv_multipart()[1:]  # without the sender's identity
        if self.secret is not None:
            frames = signing.checked(self.secret, signing.REPLY, frames, 1, "the executor")
        elif len(frames) != 1:
            logger.warning("dropped a message to the executor of %d frames (a reply has 1)", len(frames))
            frames = None
        return None if frames is None else frames[0]

    def send_shutdown(self, ranks) -> None:
        stop = pickle.dumps((0, worker_proc.SHUTDOWN, (), {}))
        for rank in ranks:
            self.send(rank, stop, False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class WorkerGroup(Protocol):
    """Where the workers of a :class:`BroadcastExecutor` run."""

    socket: WorkerSocket  # the workers' DEALERs connect to ``socket.address``
    closed: bool

    def dead_worker(self) -> str | None:
        """A message naming a worker that is gone ("worker rank 1 ... died unexpectedly ..."), or None."""

    def close(self) -> None:
        """Stop every worker (shutdown call, then force); called once or more, acts once."""


class BroadcastExecutor:
    """The :class:`~runtime.executor.base.Executor` contract over a :class:`WorkerGroup`.

    A subclass starts its workers in ``__init__`` and then calls :meth:`start` with them.
    """

    name = "broadcast"  # in messages: "the <name> executor is shut down"

    def __init__(self, config: EngineConfig):
        self.config = config
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = self.world_size - parallel.tensor_parallel_size  # first worker of the last stage
        # With a KV connector every rank answers each step: its copies count as done (a held
        # block is freed, a load is trusted) only once every rank has done its shard.
        self.step_ranks = list(range(self.world_size)) if config.cache_config.kv_connector else [self.output_rank]
        self._seq = 0
        self._results: dict[tuple[int, int], Any] = {}
        # Calls given up (failed, timed out or interrupted): their later replies, results or
        # errors, are dropped, never kept nor taken for another call's.
        self._failed: set[int] = set()
        self.workers: WorkerGroup | None = None
        self.worker_pids: list[int] = []

    def start(self, workers: WorkerGroup, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Adopt ``workers`` and wait for every rank's hello (its pid); stop them if one fails."""
        self.workers = workers
        # Stopped also when the engine is dropped without shutdown() (an offline LLM going away).
        self._finalizer = weakref.finalize(self, workers.close)
        try:
            self.worker_pids = self._wait(worker_proc.HELLO_SEQ, range(self.world_size), "startup", timeout_s=timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- the Executor contract
    def initialize(self) -> int:
        self.collective_rpc("load_model")
        num_blocks = min(self.collective_rpc("determine_num_blocks"))  # every rank must fit it
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "PendingStep":
        if scheduler_output.grammar_bitmask is not None:
            # Filled before any of the step is pickled: the fill may first collect the step in
            # flight (async scheduling), which must not change what the workers are sent.
            resolve_bitmask(scheduler_output.grammar_bitmask)
        seq = self._broadcast("execute_model", (scheduler_output,), {}, reply_ranks=set(self.step_ranks))
        return PendingStep(self, seq)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None) -> list:
        """Call ``worker.method(*args, **kwargs)`` on every rank; their results in rank order."""
        seq = self._broadcast(method, args, kwargs or {}, reply_ranks=set(range(self.world_size)))
        return self._wait(seq, range(self.world_size), method, timeout_s)

    def shutdown(self) -> None:
        if self.workers is not None:
            self._finalizer()

    def check_health(self) -> None:
        """Raise ``WorkerDied`` naming a worker that is gone; no call to the workers (the engine
        asks this on every idle pass, so that a worker dying between steps is not left unnoticed)."""
        if self.workers is None or self.workers.closed:
            return
        dead = self.workers.dead_worker()
        if dead is not None:
            raise WorkerDied(dead)

    # ---------------------------------------------------------------- messaging
    def _broadcast(self, method: str, args: tuple, kwargs: dict, reply_ranks: set[int]) -> int:
        if self.workers is None or self.workers.closed:
            raise RuntimeError(f"the {self.name} executor is shut down")
        self._seq += 1
        seq = self._seq
        data = pickle.dumps((seq, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks
        for rank in range(self.world_size):
            self.workers.socket.send(rank, data, rank in reply_ranks)
        return seq

    def _wait(self, seq: int, ranks, what: str, timeout_s: float | None = None) -> list:
        """The replies of ``ranks`` to call ``seq``, watching the workers while waiting."""
        if seq in self._failed:  # given up already (a wait for it failed): its replies are gone, never wait again
            raise WorkerDied(f"{what} failed already; its replies were dropped")
        try:
            return self._collect(seq, list(ranks), what, timeout_s)
        except BaseException:
            self._give_up(seq)
            raise

    def _give_up(self, seq: int) -> None:
        """Drop call ``seq``'s replies: those kept so far and any that come later."""
        self._failed.add(seq)
        for rank in range(self.world_size):
            self._results.pop((seq, rank), None)

    def _collect(self, seq: int, ranks: list[int], what: str, timeout_s: float | None) -> list:
        sock = self.workers.socket.sock
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any((seq, rank) not in self._results for rank in ranks):
            if sock.poll(POLL_MS):
                while sock.poll(0):
                    data = self.workers.socket.recv()
                    if data is None:
                        continue
                    reply_seq, rank, ok, payload = pickle.loads(data)
                    if not ok and reply_seq not in self._failed:
                        self._give_up(reply_seq)
                        call = what if reply_seq == seq else "an earlier call" if reply_seq < seq else "a later call"
                        self._fail(f"worker rank {rank} failed in {call}:\n{payload}")
                    if ok and reply_seq not in self._failed:
                        self._results[(reply_seq, rank)] = payload
            dead = self.workers.dead_worker()
            if dead is not None:
                self._fail(dead, grace_s=0)
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the workers did not answer {what} within {timeout_s:g} s", grace_s=0)
        return [self._results.pop((seq, rank)) for rank in ranks]

    def _fail(self, message: str, grace_s: float = DEATH_GRACE_S) -> None:
        """Raise ``WorkerDied``; a worker found dead within ``grace_s`` is named as the cause."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = self.workers.dead_worker()
            if dead is not None and dead not in message:
                message = f"{dead}; {message}"
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise WorkerDied(message)


class PendingStep:
    """A step sent to the workers; ``result()`` waits for the output rank's answer (for every
    rank's, with a KV connector: their connector reports are joined in rank order)."""

    def __init__(self, executor: BroadcastExecutor, seq: int):
        self.executor = executor
        self.seq = seq
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            ranks = self.executor.step_ranks
            outputs = self.executor._wait(self.seq, ranks, "execute_model")
            self.output = outputs[ranks.index(self.executor.output_rank)]
            if len(outputs) > 1:
                self.output.kv_connector_outputs = [r for o in outputs for r in (o.kv_connector_outputs or ())] or None
        return self.output
