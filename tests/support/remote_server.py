"""A real ``runtime serve`` subprocess on a free loopback port (helpers for tests/entrypoints)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STARTUP_TIMEOUT_S = 240.0
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "512"]


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s`` (asked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def stream(server: "RemoteServer", body: dict, first_event: threading.Event, events: list) -> None:
    """Read a streamed completion to its end (or until the server goes), noting each event."""
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    first_event.set()
    except httpx.HTTPError as exc:
        events.append(type(exc).__name__)
    first_event.set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """``python -m runtime.cli.main serve MODEL ...`` with its log in a file."""

    def __init__(self, model: str, flags: list[str], log_path, api_key: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.api_key = api_key
        self.log_path = str(log_path)
        cmd = [sys.executable, "-m", "runtime.cli.main", "serve", model, "--port", str(self.port), *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> "RemoteServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s}s:\n{self.log()}")

    @property
    def engine_pid(self) -> int:
        match = re.search(r"engine core process started \(pid (\d+)\)", self.log())
        assert match, self.log()
        return int(match.group(1))

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as {(name, sorted labels without model_name): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                samples[(sample.name, labels)] = sample.value
        return samples

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(model: str, flags: list[str], log_path, **kwargs) -> Iterator[RemoteServer]:
    """A ready ``RemoteServer`` for a module's tests; afterwards it must stop cleanly (exit 0, no traceback)."""
    srv = RemoteServer(model, flags, log_path, **kwargs).wait_ready()
    try:
        yield srv
    except BaseException:
        srv.stop()  # a failing body must not leave the server running; its own failure is reported
        raise
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def sharpen(path: str, factor: float = 8.0) -> None:
    """Scale the LM head so greedy picks are clear (a random tiny model has near-ties)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    save_file(weights, file, metadata={"format": "pt"})
