"""Issue 11: a large n stays cheap for everyone else, and SIGTERM always stops the server within seconds.

The server raises --max-n to the issue's n = 10000, so the fan-out and the
abort of 10000 child requests run for real (off the event loop, O(n)).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from support.health_watch import HealthWatch
from support.remote_server import SERVER_FLAGS, RemoteServer, is_alive, stream, wait_for

LARGE_N = 10_000
STOP_BOUND_S = 10.0  # uvicorn's 3 s of grace for open requests, then the engine's shutdown


@pytest.fixture
def large_n_server(tiny_llama, tmp_path):
    flags = SERVER_FLAGS + ["--max-n", str(LARGE_N), "--max-choices-per-request", str(LARGE_N)]
    srv = RemoteServer(tiny_llama, flags, tmp_path / "server.log").wait_ready()
    yield srv
    srv.stop()


def sigterm_and_time(server: RemoteServer) -> float:
    engine_pid = server.engine_pid
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 60 s of SIGTERM; its log ends:\n{server.log()[-4000:]}")
    seconds = time.monotonic() - start
    assert server.proc.returncode == 0, server.log()[-3000:]
    assert wait_for(lambda: not is_alive(engine_pid), 5.0), "the engine process outlived the server"
    return seconds


def test_n_10000_fans_out_and_aborts_without_stalling_others(large_n_server):
    """The issue's n = 10000 (max_tokens 2 got no answer in 60 s, /health stalled): now the fan-out and
    the abort of the 10000 children leave /health answering, and the engine is empty right after."""
    server = large_n_server
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "n": LARGE_N, "stream": True}
    with HealthWatch(server.url) as health:
        start = time.monotonic()
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as streamed:
            next(line for line in streamed.iter_lines() if line.startswith("data:"))  # all 10000 added, running
            first_event_s = time.monotonic() - start
        assert wait_for(lambda: server.metric("runtime:num_requests_running") == 0, 30.0)  # dropped: all aborted
        assert wait_for(lambda: server.metric("runtime:num_requests_waiting") == 0, 5.0)
        aborted = server.metric("runtime:request_success_total", finished_reason="abort")
    health.check()
    assert aborted == LARGE_N
    print(f"n={LARGE_N}: first event after {first_event_s:.1f}s; slowest /health {health.worst_s:.2f}s")


def test_sigterm_stops_a_busy_server_within_seconds(large_n_server):
    server = large_n_server
    readers, firsts, events = [], [], []
    bodies = [{"prompt": "hi", "max_tokens": 240, "ignore_eos": True, "n": LARGE_N}] + [
        {"prompt": "hello", "max_tokens": 240, "ignore_eos": True}
    ] * 3
    for body in bodies:
        first, seen = threading.Event(), []
        reader = threading.Thread(target=stream, args=(server, body, first, seen), daemon=True)
        reader.start()
        readers.append(reader), firsts.append(first), events.append(seen)
    assert all(first.wait(60) for first in firsts), events
    seconds = sigterm_and_time(server)
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive(), "a client still waits after the server stopped"
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    print(f"SIGTERM with {LARGE_N + 3} requests running: stopped in {seconds:.1f}s")
    assert seconds <= STOP_BOUND_S


def test_sigterm_while_the_engine_loads(tiny_llama, tmp_path):
    server = RemoteServer(tiny_llama, SERVER_FLAGS, tmp_path / "server.log")
    try:
        assert wait_for(lambda: "engine core process started" in server.log(), 120)
        seconds = sigterm_and_time(server)
    finally:
        server.stop()
    assert seconds <= STOP_BOUND_S


_INTERRUPTED_STARTUP = """
import logging, multiprocessing, sys
import runtime.engine.output_processor as output_processor
from runtime.engine.async_llm import AsyncLLM
from runtime.engine.core_client import EngineCoreClient
from runtime.engine_args import EngineArgs

logging.basicConfig(level=logging.INFO)
args = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
config = args.create_engine_config()

def interrupted(*_, **__):
    raise KeyboardInterrupt("a SIGTERM after the tokenizer loaded")

output_processor.OutputProcessor = interrupted
try:
    AsyncLLM(config, args)
except KeyboardInterrupt:
    print("engines left after the interrupted constructor:", len(multiprocessing.active_children()), flush=True)
client = EngineCoreClient(args)  # never shut down: the interpreter's exit must stop this engine
print("abandoned engine", client.process.pid, flush=True)
"""


def test_an_interrupted_startup_leaves_no_engine_behind(tiny_llama):
    """The CI failure behind this test: SIGTERM landed in AsyncLLM's constructor after the tokenizer
    loaded, outside the code that stopped the engine, and the exiting server waited on the engine forever
    (multiprocessing joins its children at exit). Now the whole constructor stops the engine on the way
    out, and any client the interpreter leaves behind is shut down at exit."""
    import re
    import subprocess
    import sys

    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _INTERRUPTED_STARTUP, tiny_llama], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engines left after the interrupted constructor: 0" in result.stdout, result.stdout
    abandoned = int(re.search(r"abandoned engine (\d+)", result.stdout).group(1))
    assert wait_for(lambda: not is_alive(abandoned), 5.0), "the abandoned engine outlived its interpreter"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    print(f"both engines stopped; the script took {time.monotonic() - start:.1f}s")


_SIGTERM_AS_THE_ENGINE_STARTS = """
import os, signal, sys
import runtime.engine.core_client as core_client
from runtime.entrypoints.openai.shutdown import stop_on_sigterm
from runtime.engine_args import EngineArgs

stop_on_sigterm()  # as runtime serve: SIGTERM raises KeyboardInterrupt
spawn = core_client.spawn_engine_core

def spawn_then_sigterm(*args, **kwargs):
    process = spawn(*args, **kwargs)
    print("engine", process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # lands before the client has recorded its engine
    return process

core_client.spawn_engine_core = spawn_then_sigterm
args = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
try:
    core_client.EngineCoreClient(args)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_sigterm_right_after_the_engine_starts(tiny_llama):
    """The test above's SIGTERM once took over 60 s: sent when the server logged that its engine process
    had started, it could land before the client recorded that process for shutdown, and the exiting
    interpreter then waited for the orphaned engine. SIGTERM now waits those few lines out."""
    import re
    import subprocess
    import sys

    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _SIGTERM_AS_THE_ENGINE_STARTS, tiny_llama], capture_output=True,
                            text=True, timeout=60)
    seconds = time.monotonic() - start
    assert result.returncode == 0 and "interrupted" in result.stdout, (result.stdout, result.stderr[-3000:])
    engine = int(re.search(r"engine (\d+)", result.stdout).group(1))
    assert wait_for(lambda: not is_alive(engine), 5.0), "the engine outlived its interpreter"
    assert seconds <= STOP_BOUND_S + 10, seconds  # interpreter start and imports, then the engine's shutdown


_SIGTERM_INSIDE = """
import os, signal, sys
import runtime.engine.async_llm as async_llm
import runtime.entrypoints.openai.api_server as api_server
from runtime.cli.main import main

module, name = {"tokenizer": (async_llm, "load_tokenizer"), "app": (api_server, "build_app")}[sys.argv[1]]
real = getattr(module, name)

def sigterm_inside_a_bare_except(*args, **kwargs):
    try:  # as a library's import inside a bare except
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):
            pass
    except BaseException as exc:
        print("swallowed", type(exc).__name__, flush=True)
    else:
        print("not interrupted inside", flush=True)
    return real(*args, **kwargs)

setattr(module, name, sigterm_inside_a_bare_except)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("where, printed", [("tokenizer", "not interrupted inside"), ("app", "swallowed KeyboardInterrupt")])
def test_a_sigterm_inside_library_code_still_stops_the_start_up(tiny_llama, where, printed):
    """Found by repeating the SIGTERM-while-loading test: about one try in ten, the signal's KeyboardInterrupt
    landed inside transformers' import of sentencepiece while the tokenizer loaded; something there swallowed
    it and the server went on to serve, the SIGTERM forgotten (or, another time, the exception passed through C
    code that set the interpreter's exit code to SIGINT's). Now the tokenizer's load holds stop signals until it
    ends ("tokenizer": nothing is raised inside it); and where a library still swallows the exception (here in
    building the app), the recorded signal stops start-up before serving ("app")."""
    import subprocess
    import sys

    from support.remote_server import free_port

    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERM_INSIDE, where, "serve", tiny_llama, "--port", str(free_port()), *SERVER_FLAGS],
        capture_output=True, text=True, timeout=120,
    )
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert printed in result.stdout, result.stdout
    assert "Uvicorn running" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    engine = int(re.search(r"engine core process started \(pid (\d+)\)", result.stderr).group(1))
    assert wait_for(lambda: not is_alive(engine), 5.0), "the engine outlived the server"
    assert seconds <= STOP_BOUND_S + 20, seconds  # interpreter start and imports, then the engine's shutdown
