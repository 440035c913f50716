"""vLLM's HTTP front-end flags through a real server on loopback: --root-path, CORS methods / headers / credentials,
--enable-request-id-headers, the uvicorn log flags, --disable-fastapi-docs and TLS."""

from __future__ import annotations

import re
import ssl
import time

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, STARTUP_TIMEOUT_S, RemoteServer
from support.tls_cert import self_signed_cert

ORIGIN = "http://a.example"
KEY = "secret-key"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_http_flags") / "server.log"
    flags = SERVER_FLAGS + [
        "--root-path", "/prefix", "--allowed-origins", ORIGIN, "--allowed-methods", '["GET", "POST"]',
        "--allowed-headers", "content-type,authorization", "--allow-credentials", "--enable-request-id-headers",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]
    srv = RemoteServer(tiny_llama, flags, log, api_key=KEY).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()


def test_root_path_prefix_is_routed_and_still_needs_the_api_key(server):
    """A proxy that keeps the prefix: "/prefix/v1/..." reaches the route, and the API key check applies to it."""
    assert httpx.get(server.url + "/prefix/v1/models").status_code == 401
    assert httpx.post(server.url + "/prefix/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
    assert httpx.get(server.url + "/prefix/v1/models", headers=server.headers()).status_code == 200
    client = server.client()
    assert client.models.list().data  # a proxy that strips the prefix
    completion = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    assert completion.usage.completion_tokens == 2


def test_root_path_is_in_the_openapi_document_and_docs(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert spec["servers"] == [{"url": "/prefix"}]
    assert "/prefix/openapi.json" in httpx.get(server.url + "/docs").text


def test_cors_methods_headers_and_credentials(server):
    def preflight(method: str, headers: str):
        return httpx.options(server.url + "/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers,
        })

    allowed = preflight("POST", "content-type,authorization")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert allowed.headers["access-control-allow-methods"] == "GET, POST"
    assert preflight("DELETE", "content-type").status_code == 400
    assert preflight("POST", "x-not-allowed").status_code == 400
    simple = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **server.headers()})
    assert simple.headers["access-control-allow-credentials"] == "true"


def test_request_id_header_is_echoed_or_made(server):
    given = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "my-id-1", **server.headers()})
    assert given.headers["x-request-id"] == "my-id-1"
    made = [httpx.get(server.url + "/health").headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in made) and made[0] != made[1]
    # errors answered by the middlewares (401 here) and streams carry it too
    assert httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "r2"}).headers["x-request-id"] == "r2"
    body = {"model": server.client().models.list().data[0].id, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"X-Request-Id": "r3", **server.headers()}) as response:
        assert response.headers["x-request-id"] == "r3"
        assert any(line == "data: [DONE]" for line in response.iter_lines())


def test_request_id_header_and_completion_id_agree(server):
    """The X-Request-Id answered is the one the completion id is made of: the client's, else the one made for it
    (also for a header too long or not ASCII to be an id, which is not echoed back)."""
    client = server.client()
    model = client.models.list().data[0].id

    def ids(headers: dict) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=1, extra_headers=headers)
        return raw.headers["x-request-id"], raw.parse().id

    assert ids({"X-Request-Id": "abc-1"}) == ("abc-1", "cmpl-abc-1")
    for headers in [{}, {"X-Request-Id": "x" * 257}]:
        made, completion_id = ids(headers)
        assert re.fullmatch(r"[0-9a-f]{32}", made) and completion_id == "cmpl-" + made, (headers, made, completion_id)
    chat = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                            max_tokens=1)
    assert chat.parse().id == "chatcmpl-" + chat.headers["x-request-id"]
    response = httpx.get(server.url + "/health", headers={"X-Request-Id": "caf\u00e9".encode()})
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


def test_access_log_off_and_uvicorn_at_warning(server):
    httpx.get(server.url + "/health")
    time.sleep(0.2)
    log = server.log()
    assert '"GET /health HTTP/1.1" 200' not in log
    assert "Uvicorn running on" not in log  # an INFO line of uvicorn's


@pytest.fixture(scope="module")
def tls_server(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("server_tls")
    cert, key = self_signed_cert(directory)
    trust = ssl.create_default_context(cafile=cert)
    srv = RemoteServer(tiny_llama, SERVER_FLAGS + ["--ssl-certfile", cert, "--ssl-keyfile", key,
                                                   "--disable-fastapi-docs"], directory / "server.log")
    url = f"https://127.0.0.1:{srv.port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert srv.proc.poll() is None, srv.log()
        try:
            if httpx.get(url + "/health", verify=trust, timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.25)
    yield srv, url, trust
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def test_tls_serves_https_to_the_openai_client(tls_server):
    import openai

    srv, url, trust = tls_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=httpx.Client(verify=trust))
    completion = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no HTTP answer
        httpx.get(srv.url + "/health", timeout=5)
    assert f"on https://127.0.0.1:{srv.port}" in srv.log()
    assert '"GET /health HTTP/1.1" 200' in srv.log()  # the access log is on by default


def test_fastapi_docs_disabled(tls_server):
    _, url, trust = tls_server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path, verify=trust).status_code == 404, path
    assert httpx.get(url + "/v1/models", verify=trust).status_code == 200
