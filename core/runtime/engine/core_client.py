"""The API side of the ZMQ link to an EngineCore process (see core_proc.py for the wire format).

``EngineCoreClient(engine_args)`` binds the two ipc sockets in a private temp dir,
spawns the engine process, waits for its READY, and then sends requests and aborts and
receives outputs. With ``--api-server-count N`` the serving parent spawns the engine for
N clients (``spawn_engine_core``) and each API process attaches with
``EngineCoreClient.attach``; the parent owns the engine, so such a client never stops it.
Death of the engine (a FATAL message or the process gone) is raised as
``EngineDeadError`` from ``get_output``; a failure before READY as
``EngineStartupError`` carrying the engine's own message.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from runtime.engine_args import EngineArgs
from runtime.engine import core_proc
from runtime.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_DEATH_POLL_S = 0.2  # how often a waiting reader checks that the engine process lives
_SHUTDOWN_WAIT_S = 5.0
# The engine reads SHUTDOWN between steps; a step can take seconds on a slow CPU. After this
# long it is sent SIGTERM, which stops it mid-step through the same cleanup (SystemExit).
_SHUTDOWN_GRACE_S = 2.0

_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine process died; no request can finish."""


class EngineStartupError(RuntimeError):
    """The engine process failed before it was ready (bad model path, out of memory ...)."""


class RequestFailedError(RuntimeError):
    """The engine failed one request for a reason on the server's side (a KV transfer that failed),
    not its input: a 500 from the server, where an input error is a ValueError (a 400)."""


@dataclass(frozen=True)
class RequestFailure:
    """The engine core rejected one request: ValueError in add_request, or later (a grammar that
    does not compile); ``server_side``: the server failed it (a KV transfer), not its input."""

    request_id: str
    message: str
    server_side: bool = False

    def error(self) -> Exception:
        return RequestFailedError(self.message) if self.server_side else ValueError(self.message)


@dataclass(frozen=True)
class UtilityResult:
    """The engine's answer to a control call (``send_utility``): ``value`` is the result when ``ok``, else
    ``[error kind, message]`` (runtime.engine.control.control_error raises it)."""

    call_id: int
    ok: bool
    value: object


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_requested = threading.Event()


def note_stop_request() -> None:
    """Record that a signal asked this process to stop (the server's SIGTERM handler calls this, then raises
    KeyboardInterrupt). Library code can swallow that exception: a bare ``except`` around an import, met while
    the tokenizer loads, did, and the server then served on. Start-up checks this record at each wait
    (:func:`raise_if_stop_requested`), so a swallowed stop still stops it."""
    _stop_requested.set()


def raise_if_stop_requested() -> None:
    """KeyboardInterrupt if a stop was requested (see :func:`note_stop_request`)."""
    if _stop_requested.is_set():
        raise KeyboardInterrupt("a stop signal arrived during start-up")


@contextlib.contextmanager
def holding_stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM received inside the block take effect when it ends.

    Around starting an engine process and recording it where shutdown finds it: a signal in
    between would unwind past the record, and the engine would outlive this process (whose
    multiprocessing exit hook then waits for it). Python runs signal handlers in the main thread
    only, so the handlers are swapped for a recorder (blocking the signals would not do: zmq's
    threads would take them).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])  # the handler it would have met


def spawn_engine_core(engine_args: EngineArgs, addresses: core_proc.EngineCoreAddresses, placement=None):
    """Start the engine process that connects to ``addresses`` (its clients bind them); ``placement``:
    a data-parallel replica's (runtime.engine.dp_placement.ReplicaPlacement)."""
    rank = "" if placement is None else f"_DP{placement.rank}"
    process = multiprocessing.get_context("spawn").Process(
        target=core_proc.run_engine_core, args=(engine_args, addresses, os.getpid(), placement), name=f"EngineCore{rank}",
    )
    with contextlib.nullcontext() if placement is None else placement.environment():
        process.start()
    where = "" if placement is None else f" for data-parallel rank {placement.rank}"
    logger.info("engine core process started (pid %d)%s", process.pid, where)
    return process


class SiblingProcess:
    """The engine as seen from an API process that did not start it (``--api-server-count`` > 1)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode = None

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
        except OSError:
            return False


class DeathState:
    """Whether the engine is gone, and why (the first reason is kept and logged)."""

    _dead_message: str | None = None

    @property
    def is_dead(self) -> bool:
        return self._dead_message is not None

    @property
    def dead_message(self) -> str | None:
        return self._dead_message

    def _mark_dead(self, message: str) -> None:
        if self._dead_message is None:
            self._dead_message = message
            logger.error(message)


class EngineCoreClient(DeathState):
    """Talks to one EngineCore process (and spawns it, unless attached). Use from a single asyncio event loop."""

    def __init__(
        self, engine_args: EngineArgs | None, addresses=None, client_index: int = 0, engine_pid: int = 0, placement=None,
    ):
        self._owns_engine = engine_args is not None
        self._dir = tempfile.mkdtemp(prefix="runtime-engine-") if self._owns_engine else None
        if self._owns_engine:
            addresses = core_proc.EngineCoreAddresses.in_dir(self._dir, 1)
        self._index = bytes([client_index])
        # Sends never block (unbounded queue), so a plain socket is safe on the event loop.
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        # A client dropped without shutdown() (its engine gone) must not block the collector on unsent requests.
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(addresses.inputs[client_index])
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(addresses.outputs[client_index])
        self._dead_message: str | None = None
        self._closed = False
        self.ready_info: dict = {}
        if self._owns_engine:
            with holding_stop_signals():
                self.process = spawn_engine_core(engine_args, addresses, placement)
                # A safety net, run before multiprocessing's own exit hook (which would wait for the engine
                # forever): an interpreter that exits without shutdown() still stops its engine.
                atexit.register(self.shutdown)
        else:
            self.process = SiblingProcess(engine_pid)

    @classmethod
    def attach(cls, addresses: core_proc.EngineCoreAddresses, client_index: int, engine_pid: int) -> "EngineCoreClient":
        """Client ``client_index`` of an engine that another process started and stops."""
        return cls(None, addresses, client_index, engine_pid)

    @property
    def engine_pids(self) -> list[int]:
        return [self.process.pid]

    async def wait_ready(self, timeout_s: float) -> dict:
        """Wait for READY; raise EngineStartupError with the engine's message if it fails first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            raise_if_stop_requested()
            if loop.time() > deadline:
                self.shutdown()
                raise EngineStartupError(f"the engine was not ready after {timeout_s:.0f}s")
            try:
                kind, payload = await self._recv(_DEATH_POLL_S)
            except EngineDeadError as exc:
                raise EngineStartupError(str(exc)) from None
            if kind is None:
                continue
            if kind == core_proc.READY:
                self.ready_info = msgspec.msgpack.decode(payload)
                return self.ready_info
            raise AssertionError(f"engine sent {kind!r} before READY")

    async def get_output(self) -> EngineCoreOutputs | RequestFailure | UtilityResult:
        """The next message from the engine; raises EngineDeadError once it is gone."""
        while True:
            kind, payload = await self._recv(_DEATH_POLL_S)
            if kind == core_proc.OUTPUTS:
                return _outputs_decoder.decode(payload)
            if kind == core_proc.FAILED:
                request_id, message, *server_side = msgspec.msgpack.decode(payload)
                return RequestFailure(request_id, message, bool(server_side and server_side[0]))
            if kind == core_proc.UTILITY_RESULT:
                return UtilityResult(*msgspec.msgpack.decode(payload))
            assert kind is None, f"unexpected engine message {kind!r}"

    async def _recv(self, timeout_s: float) -> tuple[bytes | None, bytes]:
        """One [kind, payload] message, or (None, b"") after ``timeout_s`` with the engine alive."""
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        if await self._output.poll(int(timeout_s * 1000), zmq.POLLIN):
            kind, payload = await self._output.recv_multipart()
            if kind == core_proc.FATAL:
                self._mark_dead(f"the engine failed: {msgspec.msgpack.decode(payload)}")
                raise EngineDeadError(self._dead_message)
            return kind, payload
        if self.probe_death() is not None:
            raise EngineDeadError(self._dead_message)
        return None, b""

    def probe_death(self) -> str | None:
        """Why the engine is gone, looking at its process now (not waiting for a reader to notice); None if
        it runs."""
        if self._dead_message is None and not self.process.is_alive():
            code = self.process.exitcode
            how = f"exit code {code}" if code is not None else f"pid {self.process.pid} is gone"
            self._mark_dead(f"the engine process exited unexpectedly ({how})")
        return self._dead_message

    async def get_indexed_output(self) -> tuple[int, EngineCoreOutputs | RequestFailure]:
        """``(engine index, message)``: as get_output; one engine has index 0 (see DPEngineCoreClient)."""
        return 0, await self.get_output()

    async def stop_reading(self) -> None:
        """Before ``shutdown``, on the event loop: nothing reads in the background here (see DPEngineCoreClient)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(core_proc.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            try:
                self._send(core_proc.ABORT, list(request_ids))
            except EngineDeadError:
                pass  # no engine, nothing to abort there

    def send_utility(self, call_id: int, method: str, args: list) -> int:
        """Ask the engine to run control call ``method(*args)``; its UtilityResult comes with the outputs.
        Returns the number of engines asked (one here; see DPEngineCoreClient)."""
        self._send(core_proc.UTILITY, [call_id, method, list(args)])
        return 1

    def _send(self, kind: bytes, payload) -> None:
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        if self._closed:
            raise EngineDeadError("the engine client is shut down")
        try:
            # A PUSH socket without a peer would block the event loop: once the engine's process is gone.
            self._input.send_multipart([kind, self._index, core_proc.encode(payload)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine is not connected (its process is gone)") from None

    def shutdown(self) -> None:
        """Ask the engine to stop, then terminate it if it does not; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if not self._owns_engine:
            pass  # the serving parent stops the engine
        elif self.process.is_alive() and self._dead_message is not None:
            self.process.join(_SHUTDOWN_WAIT_S)  # it reported its failure and is exiting: let it clean up
        elif self.process.is_alive() and self.ready_info:  # before READY the engine reads no input: terminate
            try:
                self._input.send_multipart([core_proc.SHUTDOWN, self._index, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(_SHUTDOWN_GRACE_S)
        if self._owns_engine:
            stop_process(self.process)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def stop_process(process, wait_s: float = _SHUTDOWN_WAIT_S) -> None:
    """Terminate ``process`` if it still runs, then kill it if it does not stop within ``wait_s``."""
    if process.is_alive():
        process.terminate()
        process.join(wait_s)
    if process.is_alive():
        process.kill()
        process.join()
