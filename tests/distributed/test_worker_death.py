"""A tensor-parallel worker killed behind ``runtime serve``: mid-generation, the request fails with
an error naming the rank within seconds; while idle, /health turns unhealthy within seconds
without waiting for a request; either way the server exits non-zero, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
from support.remote_server import SERVER_FLAGS, RemoteServer, is_alive, stream, wait_for

from runtime.testing.models import build_untokenized_model

FAIL_BOUND_S = 15.0  # from the kill to the stream's error event
STOP_BOUND_S = 30.0
IDLE_NOTICE_BOUND_S = 5.0  # from the kill to /health failing, with no request running


def start_tp2_server(tmp_path) -> tuple[RemoteServer, dict[int, int], str]:
    """A ready ``-tp 2`` server, its workers' pids by rank, and the model's path."""
    path = build_untokenized_model("llama", tmp_path / "model")
    flags = SERVER_FLAGS + ["--skip-tokenizer-init", "-tp", "2", "--max-model-len", "512"]
    server = RemoteServer(path, flags, tmp_path / "server.log").wait_ready()
    pids = {int(r): int(p) for r, p in re.findall(r"worker rank (\d+) started \(pid (\d+)\)", server.log())}
    assert sorted(pids) == [0, 1], server.log()
    return server, pids, path


def healthy(server: RemoteServer) -> bool:
    try:
        return httpx.get(server.url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:  # the server is gone already
        return False


def check_went_down(server, pids) -> None:
    """The server exits 1 within its bound, its log names rank 1's death, and no process outlives it."""
    server.proc.wait(STOP_BOUND_S)
    log = server.log()
    assert server.proc.returncode == 1, log[-3000:]
    assert f"worker rank 1 (pid {pids[1]}) died unexpectedly (killed by signal 9)" in log, log[-3000:]
    assert wait_for(lambda: not any(is_alive(pid) for pid in (server.engine_pid, *pids.values())), 10.0), (
        "a process outlived the server"
    )


def test_a_killed_worker_fails_the_request_and_stops_the_server(tmp_path):
    server, pids, path = start_tp2_server(tmp_path)
    try:
        events, started = [], threading.Event()
        # logprobs: an event per token (token-id mode has no text to stream)
        body = {"model": path, "prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True, "logprobs": 1}
        reader = threading.Thread(target=stream, args=(server, body, started, events), daemon=True)
        reader.start()
        assert started.wait(60) and events and "error" not in events[0], server.log()[-3000:]
        os.kill(pids[1], signal.SIGKILL)
        assert not any("finish_reason\":\"length" in line for line in events), "the request ended before the kill"
        killed_at = time.monotonic()
        reader.join(FAIL_BOUND_S)
        assert not reader.is_alive(), "the stream hangs after a worker died"
        assert time.monotonic() - killed_at < FAIL_BOUND_S
        assert "worker rank 1" in events[-2] and "died unexpectedly" in events[-2], events[-3:]
        assert not any('"finish_reason":"length"' in line for line in events), events[-3:]
        check_went_down(server, pids)
    finally:
        server.stop()


def test_a_worker_killed_while_idle_turns_health_unhealthy_and_stops_the_server(tmp_path):
    server, pids, _ = start_tp2_server(tmp_path)
    try:
        assert healthy(server)
        os.kill(pids[1], signal.SIGKILL)
        # No request arrives: the engine must notice the dead rank by itself.
        assert wait_for(lambda: not healthy(server), IDLE_NOTICE_BOUND_S), (
            "/health still answers 200 after a worker died: " + server.log()[-3000:]
        )
        check_went_down(server, pids)
    finally:
        server.stop()
