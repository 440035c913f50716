"""The API side of the ZMQ link to an EngineCore process (see core_proc.py for the wire format).

``EngineCoreClient`` binds the two ipc sockets in a private temp dir, spawns the
engine process, waits for its READY, and then sends requests and aborts and
receives outputs. Death of the engine (a FATAL message or the process gone) is
raised as ``EngineDeadError`` from ``get_output``; a failure before READY as
``EngineStartupError`` carrying the engine's own message.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from runtime.config import EngineArgs
from runtime.engine import core_proc
from runtime.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_DEATH_POLL_S = 0.2  # how often a waiting reader checks that the engine process lives
_SHUTDOWN_WAIT_S = 5.0

_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine process died; no request can finish."""


class EngineStartupError(RuntimeError):
    """The engine process failed before it was ready (bad model path, out of memory ...)."""


@dataclass(frozen=True)
class RequestFailure:
    """The engine core rejected one request (it raised ValueError in add_request)."""

    request_id: str
    message: str


class EngineCoreClient:
    """Spawns and talks to one EngineCore process. Use from a single asyncio event loop."""

    def __init__(self, engine_args: EngineArgs):
        self._dir = tempfile.mkdtemp(prefix="runtime-engine-")
        addresses = core_proc.EngineCoreAddresses(
            input=f"ipc://{os.path.join(self._dir, 'input')}",
            output=f"ipc://{os.path.join(self._dir, 'output')}",
        )
        # Sends never block (unbounded queue), so a plain socket is safe on the event loop.
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(addresses.input)
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(addresses.output)
        self._dead_message: str | None = None
        self._closed = False
        self.ready_info: dict = {}
        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(
            target=core_proc.run_engine_core,
            args=(engine_args, addresses, os.getpid()),
            name="EngineCore",
        )
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)

    @property
    def is_dead(self) -> bool:
        return self._dead_message is not None

    @property
    def dead_message(self) -> str | None:
        return self._dead_message

    async def wait_ready(self, timeout_s: float) -> dict:
        """Wait for READY; raise EngineStartupError with the engine's message if it fails first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
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

    async def get_output(self) -> EngineCoreOutputs | RequestFailure:
        """The next message from the engine; raises EngineDeadError once it is gone."""
        while True:
            kind, payload = await self._recv(_DEATH_POLL_S)
            if kind == core_proc.OUTPUTS:
                return _outputs_decoder.decode(payload)
            if kind == core_proc.FAILED:
                request_id, message = msgspec.msgpack.decode(payload)
                return RequestFailure(request_id, message)
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
        if not self.process.is_alive():
            self._mark_dead(f"the engine process exited unexpectedly (exit code {self.process.exitcode})")
            raise EngineDeadError(self._dead_message)
        return None, b""

    def _mark_dead(self, message: str) -> None:
        if self._dead_message is None:
            self._dead_message = message
            logger.error(message)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(core_proc.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(core_proc.ABORT, list(request_ids))

    def _send(self, kind: bytes, payload) -> None:
        if self._dead_message is not None:
            raise EngineDeadError(self._dead_message)
        if self._closed:
            raise EngineDeadError("the engine client is shut down")
        self._input.send_multipart([kind, core_proc.encode(payload)], copy=False)

    def shutdown(self) -> None:
        """Ask the engine to stop, then terminate it if it does not; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            try:
                self._input.send_multipart([core_proc.SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(_SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
