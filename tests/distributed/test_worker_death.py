"""A tensor-parallel worker killed mid-generation behind ``runtime serve``: the request fails with
an error naming the rank within seconds, and the server exits non-zero, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from support.remote_server import SERVER_FLAGS, RemoteServer, is_alive, stream, wait_for

from runtime.testing.models import build_untokenized_model

FAIL_BOUND_S = 15.0  # from the kill to the stream's error event
STOP_BOUND_S = 30.0


def test_a_killed_worker_fails_the_request_and_stops_the_server(tmp_path):
    path = build_untokenized_model("llama", tmp_path / "model")
    flags = SERVER_FLAGS + ["--skip-tokenizer-init", "-tp", "2", "--max-model-len", "512"]
    server = RemoteServer(path, flags, tmp_path / "server.log").wait_ready()
    try:
        pids = {int(r): int(p) for r, p in re.findall(r"worker rank (\d+) started \(pid (\d+)\)", server.log())}
        assert sorted(pids) == [0, 1], server.log()
        events, started = [], threading.Event()
        # logprobs: an event per token (token-id mode has no text to stream)
        body = {"model": os.path.basename(path), "prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True, "logprobs": 1}
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
        server.proc.wait(STOP_BOUND_S)
        log = server.log()
        assert server.proc.returncode == 1, log[-3000:]
        assert f"worker rank 1 (pid {pids[1]}) died unexpectedly (killed by signal 9)" in log, log[-3000:]
        assert wait_for(lambda: not any(is_alive(pid) for pid in (server.engine_pid, *pids.values())), 10.0), (
            "a process outlived the server"
        )
    finally:
        server.stop()
