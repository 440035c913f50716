"""A server started with a vLLM command line's flags (JSON --allowed-origins, --override-generation-config,
--swap-space, a zero --limit-mm-per-prompt) does what vLLM does with them; /metrics has vLLM's buckets."""

from __future__ import annotations

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer

ORIGINS = ("http://a.example", "http://b.example")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_vllm_flags") / "server.log"
    flags = SERVER_FLAGS + ["--allowed-origins", '["http://a.example", "http://b.example"]',
                            "--override-generation-config", '{"max_new_tokens": 3}', "--swap-space", "8",
                            "--limit-mm-per-prompt", '{"image": 0}']
    srv = RemoteServer(tiny_llama, flags, log).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()


def test_json_allowed_origins_allow_each_origin(server):
    for origin in ORIGINS:
        preflight = httpx.options(
            server.url + "/v1/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
        )
        assert preflight.status_code == 200, origin
        assert preflight.headers["access-control-allow-origin"] == origin
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://c.example"})
    assert "access-control-allow-origin" not in other.headers


def test_override_generation_config_is_the_default_max_tokens(server):
    client = server.client()
    chat = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    assert chat.choices[0].finish_reason == "length"


def test_metrics_have_vllms_long_buckets(server):
    client = server.client()
    client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    samples = server.metrics()
    assert samples[("vllm:time_to_first_token_seconds_bucket", (("engine", "0"), ("le", "2560.0")))] >= 1
    assert samples[("vllm:e2e_request_latency_seconds_bucket", (("engine", "0"), ("le", "7680.0")))] >= 1
    assert samples[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "abort")))] == 0
