"""``--api-server-count 2``: a process that dies takes the server down at once, with its name and a non-zero exit.

(The serving behaviour of two API processes is tested in test_server.py, which runs every test
against one and two of them.) The dead engine is killed for real; a dead API process is tested
on the parent's supervision over stand-in processes, as two real servers would cost a minute.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer, is_alive, stream, wait_for

STOP_BOUND_S = 30.0
FLAGS = SERVER_FLAGS + ["--api-server-count", "2"]
BODY = {"prompt": "hi", "max_tokens": 240, "ignore_eos": True}


@pytest.fixture
def server(tiny_llama, tmp_path):
    srv = RemoteServer(tiny_llama, FLAGS, tmp_path / "server.log").wait_ready()
    yield srv
    srv.stop()


def api_pids(server: RemoteServer) -> list[int]:
    match = re.search(r"2 API server processes \(pids (\d+), (\d+)\)", server.log())
    assert match, server.log()
    return [int(match.group(1)), int(match.group(2))]


def start_streams(server: RemoteServer, num: int) -> tuple[list[threading.Thread], list[list]]:
    readers, all_events = [], []
    for _ in range(num):
        events, started = [], threading.Event()
        reader = threading.Thread(target=stream, args=(server, BODY, started, events), daemon=True)
        reader.start()
        assert started.wait(60), server.log()[-3000:]
        readers.append(reader), all_events.append(events)
    return readers, all_events


def assert_stopped_with_error(server: RemoteServer, message: str, pids: list[int]) -> None:
    server.proc.wait(STOP_BOUND_S)
    log = server.log()
    assert server.proc.returncode == 1, log[-3000:]
    assert message in log, log[-3000:]
    assert wait_for(lambda: not any(is_alive(pid) for pid in pids), 10.0), "a process outlived the server"


def test_a_dead_api_process_stops_the_others_and_the_engine():
    """The parent's supervision over stand-in processes (the real ones take half a minute to start)."""
    import multiprocessing
    import time

    from runtime.entrypoints.openai import api_servers

    fork = multiprocessing.get_context("fork")
    engine = fork.Process(target=time.sleep, args=(60,))
    workers = [fork.Process(target=time.sleep, args=(60,)), fork.Process(target=os._exit, args=(3,))]
    for process in (engine, *workers):
        process.start()
    start = time.monotonic()
    failure = api_servers._watch(engine, workers)
    assert failure == f"API server process 1 (pid {workers[1].pid}) exited unexpectedly (exit code 3)"
    api_servers._stop_all(engine, workers, 0.0)
    assert not any(p.is_alive() for p in (engine, *workers)) and time.monotonic() - start < 10
    assert workers[0].exitcode == -signal.SIGTERM and engine.exitcode == -signal.SIGTERM


def test_a_dead_engine_fails_the_streams_of_both_processes(server):
    engine_pid, pids = server.engine_pid, api_pids(server)
    readers, events = start_streams(server, 4)
    os.kill(engine_pid, signal.SIGKILL)
    for reader in readers:
        reader.join(15)
        assert not reader.is_alive(), "a stream hangs after the engine died"
    for lines in events:  # each stream ends with an error event naming the cause, none completes
        assert lines[-1] == "data: [DONE]" and "the engine process exited unexpectedly" in lines[-2], lines[-3:]
        assert not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    assert_stopped_with_error(server, "the engine process exited unexpectedly", [engine_pid, *pids])
