"""Issue 11: schemathesis, driven by the server's own /openapi.json, finds no way to crash or hang it.

A live ``runtime serve`` on a tiny model gets every operation fuzzed in
positive and negative modes (schema-valid and schema-breaking bodies), coverage
then fuzzing, deterministically (the same cases every run). Asserted: no 5xx,
no request slower than the response-time bound, every error in OpenAI's shape,
/health answering within 1 s throughout, and no traceback in the server log.
A max_model_len of 40 keeps each generated request short (at most 39 tokens
per sequence, up to 128 sequences), which bounds the run: about 1,000 cases in
40-60 s on a shared 2-core machine, plus the server's start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import support
from support.health_watch import HealthWatch
from support.remote_server import SERVER_FLAGS, RemoteServer

MAX_EXAMPLES = 20  # per operation, for the fuzzing phase (coverage cases come on top)
MAX_RESPONSE_S = 15  # a request slower than this counts as a hang
RUN_TIMEOUT_S = 300  # the whole run, a safety net
CHECKS = Path(support.__file__).with_name("schemathesis_checks.py")


def schemathesis_run(url: str, workdir: Path) -> subprocess.CompletedProcess:
    """``st run`` in ``workdir`` (where it keeps its files), with this suite's checks."""
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json",
        "--mode", "all", "--phases", "examples,coverage,fuzzing",
        "--checks", "not_a_server_error,openai_error_shape",
        "--max-response-time", str(MAX_RESPONSE_S), "--request-timeout", str(2 * MAX_RESPONSE_S),
        "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--workers", "1",
        "--no-color", "--report", "junit", "--report-junit-path", str(workdir / "junit.xml"),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(CHECKS)}
    return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=workdir)


def test_schemathesis_finds_no_server_error_or_hang(tiny_llama, tmp_path):
    server = RemoteServer(tiny_llama, SERVER_FLAGS + ["--max-model-len", "40"], tmp_path / "server.log").wait_ready()
    try:
        with HealthWatch(server.url, interval_s=0.2) as health:
            start = time.monotonic()
            run = schemathesis_run(server.url, tmp_path)
            seconds = time.monotonic() - start
    finally:
        exit_code = server.stop()
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    assert " passed" in output and "failed" not in output.split("SUMMARY")[-1], output[-3000:]
    health.check()
    cases = next((line.strip() for line in output.splitlines() if " generated, " in line), "?")
    print(f"schemathesis: {cases} in {seconds:.0f}s; slowest /health {health.worst_s:.2f}s of {health.num_checks}")
    log = server.log()
    assert exit_code == 0 and "Traceback" not in log, log[-5000:]
