"""The EngineCore busy loop in its own process, fed over ZMQ (vLLM V1 process model).

The API process binds two ipc sockets and spawns this process, which connects:

    API  --PUSH--> input  --PULL--> engine   [kind, payload]: ADD | ABORT | SHUTDOWN
    API  <--PULL-- output <--PUSH-- engine   [kind, payload]: READY | OUTPUTS | FAILED | FATAL

Payloads are msgspec msgpack. The engine rebuilds its EngineConfig from the
EngineArgs it is given (loading the model itself), says READY, then loops:
block on input while idle, else drain input, step, and send the outputs (with
scheduler stats for /metrics). A startup or step error is sent as FATAL before
the process exits non-zero; a request the core rejects is sent as FAILED.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from runtime.config import EngineArgs
from runtime.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

# Input kinds (API -> engine)
ADD = b"ADD"
ABORT = b"ABORT"
SHUTDOWN = b"SHUTDOWN"
# Output kinds (engine -> API)
READY = b"READY"
OUTPUTS = b"OUTPUTS"
FAILED = b"FAILED"  # payload: [request_id, message]; the core rejected one request
FATAL = b"FATAL"  # payload: message; the engine is going down

_IDLE_POLL_MS = 500  # while idle, check this often that the API process still lives

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_abort_decoder = msgspec.msgpack.Decoder(list[str])


def encode(payload) -> bytes:
    return _encoder.encode(payload)


@dataclass(frozen=True)
class EngineCoreAddresses:
    input: str  # the API pushes requests here
    output: str  # the engine pushes outputs here


class EngineCoreProc:
    """Runs one EngineCore against a pair of connected sockets until SHUTDOWN or death."""

    def __init__(self, engine_core, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int):
        self.core = engine_core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self._last_stats: dict | None = None
        self._running = True

    def run(self) -> None:
        while self._running:
            if self.core.has_unfinished_requests():
                self._drain_input(timeout_ms=0)
                if self.core.has_unfinished_requests():
                    self._send_outputs(self.core.step())
            else:
                self._send_idle_stats()
                self._drain_input(timeout_ms=_IDLE_POLL_MS)
            self._check_parent()

    def _drain_input(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to ``timeout_ms`` for the first."""
        while self._running and self.input.poll(timeout_ms, zmq.POLLIN):
            kind, payload = self.input.recv_multipart(copy=False)
            self._handle(kind.bytes, payload.buffer)
            timeout_ms = 0

    def _handle(self, kind: bytes, payload) -> None:
        if kind == ADD:
            request = _request_decoder.decode(payload)
            try:
                self.core.add_request(request)
            except ValueError as exc:
                self.output.send_multipart([FAILED, encode([request.request_id, str(exc)])])
        elif kind == ABORT:
            self.core.abort_requests(_abort_decoder.decode(payload))
        elif kind == SHUTDOWN:
            self._running = False
        else:
            raise AssertionError(f"unknown engine input kind {kind!r}")

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        outputs.timestamp = time.time()
        self._last_stats = outputs.scheduler_stats
        if outputs.outputs or outputs.scheduler_stats:
            self.output.send_multipart([OUTPUTS, encode(outputs)], copy=False)

    def _send_idle_stats(self) -> None:
        """After the last step or an abort, report the idle counts once."""
        stats = self.core.scheduler.stats()
        if stats != self._last_stats:
            self._send_outputs(EngineCoreOutputs(scheduler_stats=stats))

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            logger.warning("the API process %d is gone; the engine exits", self.parent_pid)
            self._running = False


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_engine_core(engine_args: EngineArgs, addresses: EngineCoreAddresses, parent_pid: int) -> None:
    """Process entry point: load the model, say READY, serve until SHUTDOWN."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [engine] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    signal.signal(signal.SIGTERM, _raise_system_exit)
    ctx = zmq.Context()
    output = ctx.socket(zmq.PUSH)
    output.setsockopt(zmq.SNDHWM, 0)
    output.connect(addresses.output)
    input_socket = ctx.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(addresses.input)
    core = None
    exit_code = 0
    try:
        core = _start_core(engine_args, output)
        EngineCoreProc(core, input_socket, output, parent_pid).run()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the API process
        traceback.print_exc()
        output.send_multipart([FATAL, encode(f"{type(exc).__name__}: {exc}")])
        exit_code = 1
    finally:
        if core is not None:
            core.shutdown()
        output.close(linger=2000)
        input_socket.close(linger=0)
        ctx.term()
    sys.exit(exit_code)


def _start_core(engine_args: EngineArgs, output: zmq.Socket):
    from runtime.engine.core import EngineCore

    config = engine_args.create_engine_config()
    core = EngineCore(config)
    ready = {
        "pid": os.getpid(),
        "num_blocks": int(core.num_blocks),
        "max_model_len": int(config.model_config.max_model_len),
    }
    output.send_multipart([READY, encode(ready)])
    logger.info("engine core ready: %s", ready)
    return core
