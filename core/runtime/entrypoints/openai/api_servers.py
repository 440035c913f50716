"""``runtime serve --api-server-count N``: N API processes in front of one engine core (vLLM's flag).

The parent process binds the listening socket, spawns the engine core for N clients
(with ``--data-parallel-size M``, M engine cores, each for the N clients) and N API
processes, and then only watches them. Each API process accepts connections from the
shared socket (the kernel hands each connection to one of them), tokenizes, and talks
to each engine over its own pair of ZMQ sockets; an engine sends every request's
outputs back to the process that added it. With data parallelism each API process
balances its own requests over the engine cores.
Prometheus runs in multiprocess mode over a private folder, so /metrics, answered
by any process, shows the sums over all of them (engine gauges come from process 0,
the only one the engines send their scheduler stats to).

If any process dies (an API process, or an engine), the others are stopped and the
parent exits 1 naming it; after SIGINT or SIGTERM everything stops and it exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from runtime.config import EngineConfig
from runtime.engine.core_client import (
    EngineCoreClient, holding_stop_signals, raise_if_stop_requested, spawn_engine_core, stop_process,
)
from runtime.engine.core_proc import EngineCoreAddresses
from runtime.engine.dp_client import DPEngineCoreClient
from runtime.engine.dp_placement import replica_placements
from runtime.engine_args import EngineArgs
from runtime.entrypoints.openai.mp_metrics import MultiProcessMetrics

logger = logging.getLogger("runtime.server")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported
_STOP_WAIT_S = 15.0  # uvicorn's grace for open requests, then the API process's shutdown
_ENGINE_DEATH_WAIT_S = 10.0  # the API processes' grace after the engine's death (3 s), and their shutdown
_PARENT_POLL_S = 1.0


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_scheme(args) -> str:
    """How the server is reached: https with --ssl-certfile, else http."""
    return "https" if getattr(args, "ssl_certfile", None) else "http"


def run_api_servers(args, engine_args: EngineArgs, config: EngineConfig | None = None) -> int:
    """Serve with ``args.api_server_count`` API processes until stopped; the exit code of ``runtime serve``."""
    count = args.api_server_count
    # Ctrl-C stops everything, also when started with SIGINT ignored (in the background of a shell):
    # a single API process gets the same from uvicorn.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"runtime: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    folder = tempfile.mkdtemp(prefix="runtime-serve-")
    metrics_dir = os.path.join(folder, "metrics")
    os.mkdir(metrics_dir)
    engines, workers = [], None
    try:
        placements = replica_placements(engine_args, config or engine_args.create_engine_config())
        addresses = [_engine_addresses(folder, rank, len(placements), count) for rank in range(len(placements))]
        for (replica_args, placement), replica_addresses in zip(placements, addresses):
            with holding_stop_signals():  # started and recorded for _stop_all, or not started
                engines.append(spawn_engine_core(replica_args, replica_addresses, placement if len(placements) > 1 else None))
        os.environ[METRICS_DIR_ENV] = metrics_dir  # before the API processes import prometheus_client
        mp = multiprocessing.get_context("spawn")
        pids = [engine.pid for engine in engines]
        workers = [
            mp.Process(target=run_api_process, args=(args, engine_args, addresses, i, pids, sock), name=f"APIServer-{i}")
            for i in range(count)
        ]
        for worker in workers:
            worker.start()
        logger.info("%d API server processes (pids %s) share %s://%s:%d", count, ", ".join(str(w.pid) for w in workers),
                    url_scheme(args), args.host, args.port)
        raise_if_stop_requested()  # a SIGTERM during start-up whose KeyboardInterrupt a library swallowed
        failure = _watch(engines, workers)
    except KeyboardInterrupt:
        failure = None
    finally:
        # After an engine's death the API processes fail their requests with its reason and exit on their own.
        engine_died = any(engine.exitcode is not None for engine in engines)
        _stop_all(engines, workers or [], _ENGINE_DEATH_WAIT_S if engine_died else 0.0)
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    if failure is not None:
        print(f"runtime: error: {failure}; the server stopped", file=sys.stderr)
        return 1
    return 0


def _engine_addresses(folder: str, rank: int, num_engines: int, num_clients: int) -> EngineCoreAddresses:
    """The sockets of engine ``rank``: in ``folder`` itself with one engine, else in its own subfolder."""
    if num_engines > 1:
        folder = os.path.join(folder, f"dp{rank}")
        os.mkdir(folder)
    return EngineCoreAddresses.in_dir(folder, num_clients)


def _engine_list(engines) -> list:
    return engines if isinstance(engines, list) else [engines] if engines is not None else []


def _watch(engines, workers) -> str | None:
    """Wait until a process ends; say which, and how, unless it ended cleanly. ``engines``: one or a list."""
    engines = _engine_list(engines)
    processes = {
        e.sentinel: ("the engine process" if len(engines) == 1 else f"the engine process of data-parallel rank {r}", e)
        for r, e in enumerate(engines)
    }
    processes.update({w.sentinel: (f"API server process {i} (pid {w.pid})", w) for i, w in enumerate(workers)})
    ready = multiprocessing.connection.wait(list(processes))
    name, process = processes[ready[0]]
    process.join()
    if process not in engines and process.exitcode == 0:
        return None  # stopped by a signal sent to it alone: stop the rest too
    return f"{name} exited unexpectedly (exit code {process.exitcode})"


def _stop_all(engines, workers, grace_s: float) -> None:
    """API processes first (after ``grace_s`` to stop by themselves, SIGTERM: they abort their requests
    and stop serving), then the engines (one or a list)."""
    _join_all(workers, grace_s)
    for worker in workers:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGTERM)
    _join_all(workers, _STOP_WAIT_S)
    for worker in workers:
        stop_process(worker)
    for engine in _engine_list(engines):
        stop_process(engine)


def _join_all(processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))


# ----------------------------------------------------------- one API process
def run_api_process(args, engine_args: EngineArgs, addresses: list, index: int, engine_pids: list[int], sock) -> None:
    """Process entry point of API server ``index``: serve on ``sock`` until told to stop."""
    from runtime.entrypoints.openai.api_server import run_event_loop, serve
    from runtime.entrypoints.openai.shutdown import stop_on_sigterm

    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s %(name)s[api{index}]: %(message)s")
    stop_on_sigterm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops this process
    try:
        config = engine_args.create_engine_config()
        clients = [EngineCoreClient.attach(a, index, pid) for a, pid in zip(addresses, engine_pids)]
        engine_core = clients[0] if len(clients) == 1 else DPEngineCoreClient(clients)
    except KeyboardInterrupt:
        sys.exit(0)
    metrics = MultiProcessMetrics(config.model_config.served_model_name, metrics_dir=os.environ[METRICS_DIR_ENV])
    main = serve(args, engine_args, config, sock=sock, engine_core=engine_core, metrics=metrics,
                 watchdog=_exit_with_parent(os.getppid()))
    sys.exit(run_event_loop(main))


async def _exit_with_parent(parent_pid: int) -> None:
    """Return once the parent is gone (then the caller stops serving)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(_PARENT_POLL_S)
    logger.error("the serving parent %d is gone; this API process stops", parent_pid)
