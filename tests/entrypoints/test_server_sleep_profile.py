"""The server's control routes (vLLM's): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache with
RUNTIME_SERVER_DEV_MODE=1 and --enable-sleep-mode, and /start_profile, /stop_profile with
RUNTIME_TORCH_PROFILER_DIR; the calls reach the engine process and its refusals are 400s in OpenAI's shape."""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer

COMPLETION = {"prompt": "hello there", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server_profile")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory, profile_dir):
    log = tmp_path_factory.mktemp("server_sleep") / "server.log"
    env = {"RUNTIME_SERVER_DEV_MODE": "1", "RUNTIME_TORCH_PROFILER_DIR": str(profile_dir)}
    srv = RemoteServer(tiny_llama, SERVER_FLAGS + ["--enable-sleep-mode"], log, env=env).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()


def complete(server) -> httpx.Response:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/completions", json={**COMPLETION, "model": model}, timeout=60)


def is_sleeping(server) -> bool:
    return httpx.get(server.url + "/is_sleeping").json()["is_sleeping"]


def assert_error(response: httpx.Response, pattern: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    assert re.search(pattern, error["message"]), error["message"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_over_http(server, level):
    reference = complete(server).json()["choices"][0]["text"]
    assert not is_sleeping(server)
    assert httpx.post(server.url + "/sleep", params={"level": level}, timeout=60).status_code == 200
    assert is_sleeping(server)
    assert_error(complete(server), r"the engine is asleep \(sleep level \d.*call wake_up\(\)")
    assert_error(httpx.post(server.url + "/sleep"), r"already asleep")
    assert httpx.post(server.url + "/wake_up", params={"tags": "weights"}, timeout=60).status_code == 200
    assert is_sleeping(server)  # the KV cache still sleeps
    assert httpx.post(server.url + "/wake_up", timeout=60).status_code == 200
    assert not is_sleeping(server)
    assert complete(server).json()["choices"][0]["text"] == reference


def test_bad_sleep_arguments_are_400s(server):
    assert_error(httpx.post(server.url + "/sleep", params={"level": 3}), r"sleep level 3 is not valid; valid: 1 \(")
    assert_error(httpx.post(server.url + "/sleep", params={"level": "deep"}), r"level")
    assert_error(httpx.post(server.url + "/wake_up", params={"tags": "kv"}), "wake_up tag 'kv' is not valid; valid: weights, kv_cache")
    assert not is_sleeping(server)
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200


def test_profile_over_http(server, profile_dir):
    assert httpx.post(server.url + "/start_profile", timeout=60).status_code == 200
    assert_error(httpx.post(server.url + "/start_profile"), r"already recording")
    assert complete(server).status_code == 200
    assert httpx.post(server.url + "/stop_profile", timeout=60).status_code == 200
    assert [p.suffix for p in profile_dir.glob("rank0.*.trace.json")] == [".json"]
    assert_error(httpx.post(server.url + "/stop_profile"), r"no profile is recording")


def test_dev_routes_need_dev_mode_and_the_engine_refusal_is_a_400(monkeypatch):
    from fastapi.testclient import TestClient

    from runtime.engine.control import EngineControlError
    from runtime.entrypoints.openai.api_server import build_app
    from runtime.metrics import EngineMetrics

    async def refuse():
        raise EngineControlError("start_profile() needs RUNTIME_TORCH_PROFILER_DIR")

    engine = SimpleNamespace(metrics=EngineMetrics("m"), model_config=SimpleNamespace(served_model_name="m"),
                             is_dead=False, start_profile=refuse)
    monkeypatch.delenv("RUNTIME_SERVER_DEV_MODE", raising=False)
    client = TestClient(build_app(SimpleNamespace(), engine))
    assert client.post("/sleep").status_code == 404 and client.get("/is_sleeping").status_code == 404
    assert_error(client.post("/start_profile"), "needs RUNTIME_TORCH_PROFILER_DIR")
    monkeypatch.setenv("RUNTIME_SERVER_DEV_MODE", "1")
    dev = TestClient(build_app(SimpleNamespace(), engine))
    assert_error(dev.post("/sleep", params={"level": "x"}), r"level: Input should be a valid integer")
