"""The EngineCore busy loop in its own process, fed over ZMQ (vLLM V1 process model).

Each API process (client) binds two ipc sockets; this process connects to all of them:

    API i --PUSH--> input i  --PULL--> engine   [kind, client index, payload]: ADD | ABORT | UTILITY | SHUTDOWN
    API i <--PULL-- output i <--PUSH-- engine   [kind, payload]: READY | OUTPUTS | FAILED | UTILITY_RESULT | FATAL

With ``--api-server-count N`` there are N clients: the engine remembers which client
added each request and sends its outputs (and failures) only there; scheduler stats go
to client 0 alone, so that counters derived from them are counted once. With
``--data-parallel-size`` there is one such process per replica, each with its own
sockets (runtime.engine.dp_client balances the requests over them).

Payloads are msgspec msgpack. The engine rebuilds its EngineConfig from the
EngineArgs it is given (loading the model itself), says READY, then loops:
block on input while idle, else drain input, step, and send the outputs (with
scheduler stats for /metrics). While idle it also asks the executor whether its
workers still live (``check_health``, when the executor has it), so that a worker
that dies between requests brings the engine down at once. A startup, step or
worker error is sent as FATAL before the process exits non-zero; a request the
core rejects is sent as FAILED. A UTILITY message ([call id, method, args]) runs one of the core's control
calls (sleep, wake_up, profiling: runtime.engine.control) between steps and answers the client that sent it
with UTILITY_RESULT ([call id, ok, result or [error kind, message]]).
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

from runtime.engine_args import EngineArgs
from runtime.engine.control import run_control_call
from runtime.messages import EngineCoreOutputs, EngineCoreRequest, NewTokens

logger = logging.getLogger(__name__)

# Input kinds (API -> engine)
ADD = b"ADD"
ABORT = b"ABORT"
UTILITY = b"UTILITY"  # payload: [call id, method, args]; a control call (runtime.engine.control)
SHUTDOWN = b"SHUTDOWN"
# Output kinds (engine -> API)
READY = b"READY"
OUTPUTS = b"OUTPUTS"
FAILED = b"FAILED"  # payload: [request_id, message(, server_side)]; the core failed one request
UTILITY_RESULT = b"UTILITY_RESULT"  # payload: [call id, ok, result or [error kind, message]]
FATAL = b"FATAL"  # payload: message; the engine is going down

_IDLE_POLL_MS = 500  # while idle, check this often that the API process and the workers still live

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_abort_decoder = msgspec.msgpack.Decoder(list[str])
_utility_decoder = msgspec.msgpack.Decoder(tuple[int, str, list])


def encode(payload) -> bytes:
    return _encoder.encode(payload)


@dataclass(frozen=True)
class EngineCoreAddresses:
    inputs: tuple[str, ...]  # client i pushes requests to inputs[i]
    outputs: tuple[str, ...]  # the engine pushes client i's outputs to outputs[i]

    @classmethod
    def in_dir(cls, folder: str, num_clients: int) -> "EngineCoreAddresses":
        return cls(
            inputs=tuple(f"ipc://{os.path.join(folder, f'input{i}')}" for i in range(num_clients)),
            outputs=tuple(f"ipc://{os.path.join(folder, f'output{i}')}" for i in range(num_clients)),
        )


class EngineCoreProc:
    """Runs one EngineCore against a pair of connected sockets until SHUTDOWN or death."""

    def __init__(self, engine_core, input_socket: zmq.Socket, outputs: list[zmq.Socket], parent_pid: int):
        self.core = engine_core
        self.input = input_socket
        self.outputs = outputs  # one per client
        self.parent_pid = parent_pid
        self._owner: dict[str, int] = {}  # request id -> client index (only with several clients)
        self._last_stats: dict | None = None
        self._running = True
        # Optional on executors (read with getattr): raises if a worker is gone. Cheap (no call
        # to the workers), so asked on every idle pass; a busy step finds a dead worker itself.
        self._check_workers = getattr(getattr(engine_core, "executor", None), "check_health", None)

    def run(self) -> None:
        while self._running:
            if self.core.has_unfinished_requests():
                self._drain_input(timeout_ms=0)
                if self.core.has_unfinished_requests():
                    self._send_outputs(self.core.step())
            else:
                self._send_idle_stats()
                self._drain_input(timeout_ms=_IDLE_POLL_MS)
                if self._check_workers is not None:
                    self._check_workers()
            self._check_parent()

    def _drain_input(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to ``timeout_ms`` for the first."""
        while self._running and self.input.poll(timeout_ms, zmq.POLLIN):
            kind, client, payload = self.input.recv_multipart(copy=False)
            self._handle(kind.bytes, client.bytes[0], payload.buffer)
            timeout_ms = 0

    def _handle(self, kind: bytes, client: int, payload) -> None:
        if kind == ADD:
            request = _request_decoder.decode(payload)
            try:
                self.core.add_request(request)
            except ValueError as exc:
                self.outputs[client].send_multipart([FAILED, encode([request.request_id, str(exc)])])
                return
            if len(self.outputs) > 1:
                self._owner[request.request_id] = client
        elif kind == ABORT:
            request_ids = _abort_decoder.decode(payload)
            self.core.abort_requests(request_ids)
            for request_id in request_ids:
                self._owner.pop(request_id, None)
        elif kind == UTILITY:
            call_id, method, args = _utility_decoder.decode(payload)
            ok, result = run_control_call(self.core, method, args)
            self.outputs[client].send_multipart([UTILITY_RESULT, encode([call_id, ok, result])])
        elif kind == SHUTDOWN:
            self._running = False
        else:
            raise AssertionError(f"unknown engine input kind {kind!r}")

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.failed:
            server_failed = set(outputs.server_failed or ())
            for request_id, message in outputs.failed.items():
                client = self._owner.pop(request_id, 0)
                self.outputs[client].send_multipart([FAILED, encode([request_id, message, request_id in server_failed])])
            outputs.failed = outputs.server_failed = None
        outputs.timestamp = time.time()
        self._last_stats = outputs.scheduler_stats
        if len(self.outputs) > 1:
            self._send_routed(outputs)
        elif outputs.outputs or outputs.new_tokens or outputs.scheduler_stats:
            self.outputs[0].send_multipart([OUTPUTS, encode(outputs)], copy=False)

    def _send_routed(self, outputs: EngineCoreOutputs) -> None:
        """Each client's share of one step; client 0 also gets the scheduler stats."""
        groups: list[list] = [[] for _ in self.outputs]
        token_groups = [NewTokens([], []) for _ in self.outputs]
        owner = self._owner
        for output in outputs.outputs:
            client = owner.pop(output.request_id, None) if output.finish_reason is not None else owner.get(output.request_id)
            if client is not None:  # None: aborted by its client meanwhile
                groups[client].append(output)
        if outputs.new_tokens is not None:
            for request_id, token in zip(outputs.new_tokens.request_ids, outputs.new_tokens.token_ids):
                client = owner.get(request_id)
                if client is not None:
                    token_groups[client].request_ids.append(request_id)
                    token_groups[client].token_ids.append(token)
        for client, (group, tokens) in enumerate(zip(groups, token_groups)):
            stats = outputs.scheduler_stats if client == 0 else None
            tokens = tokens if tokens.request_ids else None
            if group or tokens or stats:
                message = EngineCoreOutputs(outputs=group, timestamp=outputs.timestamp, scheduler_stats=stats, new_tokens=tokens)
                self.outputs[client].send_multipart([OUTPUTS, encode(message)], copy=False)

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


def run_engine_core(engine_args: EngineArgs, addresses: EngineCoreAddresses, parent_pid: int, placement=None) -> None:
    """Process entry point: load the model, say READY, serve until SHUTDOWN. ``placement``: this data-parallel
    replica's devices or CPU share (runtime.engine.dp_placement), applied before anything starts a device."""
    name = "engine" if placement is None else f"engine dp{placement.rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [{name}] %(message)s")
    if placement is not None:
        placement.apply()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    signal.signal(signal.SIGTERM, _raise_system_exit)
    ctx = zmq.Context()
    outputs = []
    for address in addresses.outputs:
        output = ctx.socket(zmq.PUSH)
        output.setsockopt(zmq.SNDHWM, 0)
        output.connect(address)
        outputs.append(output)
    input_socket = ctx.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    for address in addresses.inputs:
        input_socket.connect(address)
    core = None
    exit_code = 0
    try:
        core = _start_core(engine_args, outputs)
        EngineCoreProc(core, input_socket, outputs, parent_pid).run()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the API processes
        traceback.print_exc()
        for output in outputs:
            output.send_multipart([FATAL, encode(f"{type(exc).__name__}: {exc}")])
        exit_code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a terminate while cleaning up ends the process quietly
        if core is not None:
            core.shutdown()
        for output in outputs:
            output.close(linger=2000)
        input_socket.close(linger=0)
        ctx.term()
    sys.exit(exit_code)


def _start_core(engine_args: EngineArgs, outputs: list[zmq.Socket]):
    from runtime.engine.core import EngineCore

    config = engine_args.create_engine_config()
    core = EngineCore(config)
    ready = {
        "pid": os.getpid(),
        "num_blocks": int(core.num_blocks),
        "max_model_len": int(config.model_config.max_model_len),
    }
    for output in outputs:
        output.send_multipart([READY, encode(ready)])
    logger.info("engine core ready: %s", ready)
    return core
