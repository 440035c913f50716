"""Issue 19: one prefill and one decode ``runtime serve`` behind ``runtime proxy`` (real processes
on loopback, the official openai client). Completions and chats through the proxy equal a single
server's, streamed and not; the decode instance computes only the prompt's tail; blocks are freed
on both sides afterwards; an unpulled lease expires; a dead prefill instance makes the decode
instance recompute. One set of processes serves the module (the last test kills the prefill one);
the decode instance schedules asynchronously (``--async-scheduling``), the prefill one does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer, free_port, wait_for

LEASE_S = 2.0
PROMPT = " ".join(f"word{i}" for i in range(30)) + " and so the story goes"
MESSAGES = [{"role": "user", "content": "Tell me about " + " ".join(f"topic{i}" for i in range(20))}]
MAX_TOKENS = 8
FLAGS = SERVER_FLAGS + ["--enforce-eager"]  # no decode graphs to compile: three processes start on two cores
USAGE = "runtime:kv_cache_usage_perc"


def transfer_flags(role: str, port: int, **extra) -> list[str]:
    config = {"kv_connector": "TcpConnector", "kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


class Proxy:
    def __init__(self, prefill: str, decode: str, log_path):
        self.port = free_port()
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "runtime.cli.main", "proxy", "--prefill", prefill, "--decode", decode, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> "Proxy":
        def up():
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, 240), open(self._log.name).read()
        return self

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        self._log.close()


def running_pd(model: str, logs, prefill_flags: list[str], decode_flags: list[str], prefill_env=None, decode_env=None):
    """Yield (prefill server, decode server, proxy), started side by side; stopped afterwards."""
    prefill = RemoteServer(model, prefill_flags, logs / "prefill.log", env=prefill_env)
    decode = RemoteServer(model, decode_flags, logs / "decode.log", env=decode_env)
    proxy = Proxy(prefill.url, decode.url, logs / "proxy.log")
    try:
        prefill.wait_ready(), decode.wait_ready(), proxy.wait_ready()
        yield prefill, decode, proxy
    finally:
        proxy.stop()
        for server in (prefill, decode):
            server.stop()


@pytest.fixture(scope="module")
def pd(tiny_pd_model, tmp_path_factory):
    """(prefill server, decode server, proxy), started side by side."""
    for prefill, decode, proxy in running_pd(
        tiny_pd_model, tmp_path_factory.mktemp("pd"), FLAGS + transfer_flags("kv_producer", free_port(), lease_s=LEASE_S),
        FLAGS + ["--async-scheduling"] + transfer_flags("kv_consumer", free_port(), pull_timeout_s=2),
    ):
        yield prefill, decode, proxy
    assert "Traceback" not in decode.log(), decode.log()


def completion(client, prompt=PROMPT, **kwargs) -> str:
    if kwargs.pop("stream", False):
        chunks = client.completions.create(model=None, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, **kwargs)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=None, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kwargs).choices[0].text


def chat(client, stream=False) -> str:
    kwargs = dict(model=served_model(client), messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(**kwargs).choices[0].message.content


def served_model(client) -> str:
    return client.models.list().data[0].id


def check_outputs_equal_a_single_server(prefill, proxy) -> None:
    """Completions and chats through the proxy, streamed and not, equal the prefill instance's own."""
    single, client = prefill.client(), proxy.client()  # the prefill instance answers plain requests as any server
    expected = completion(single)
    assert expected and completion(client) == expected
    assert completion(client, stream=True) == expected
    expected_chat = chat(single)
    assert expected_chat and chat(client) == expected_chat
    assert chat(client, stream=True) == expected_chat


def test_completions_and_chats_equal_a_single_server(pd):
    prefill, decode, proxy = pd
    check_outputs_equal_a_single_server(prefill, proxy)
    assert proxy.client().models.list().data[0].id == served_model(decode.client())


def test_the_decode_instance_computes_only_the_tail(pd):
    prefill, decode, proxy = pd
    hits_before = decode.metric("runtime:prefix_cache_hits_total")
    prompt = "A fresh prompt: " + " ".join(f"item{i}" for i in range(40))
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).json()
    num_prompt, cached = response["usage"]["prompt_tokens"], response["usage"]["prompt_tokens_details"]["cached_tokens"]
    # every prompt token but the last, the last block partly full: the decode instance computes one token
    assert cached == num_prompt - 1 and cached % 16 and cached >= 32, response
    assert decode.metric("runtime:prefix_cache_hits_total") == hits_before  # pulled, not found in its own cache
    assert response["choices"][0]["text"] == completion(prefill.client(), prompt=prompt)


def test_blocks_are_freed_on_both_sides(pd):
    prefill, decode, proxy = pd
    completion(proxy.client(), prompt=PROMPT + " once more")
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0 and decode.metric(USAGE) == 0.0, 10)
    assert prefill.metric(USAGE) == 0.0 and decode.metric(USAGE) == 0.0


def test_a_lease_nobody_pulls_expires(pd):
    prefill, _, _ = pd
    body = {"prompt": "Nobody pulls this: " + " ".join(f"x{i}" for i in range(40)), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()
    params = response["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) >= 2 and params["remote_port"]
    assert wait_for(lambda: prefill.metric(USAGE) > 0.0, 5)  # held past the request's end
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0, LEASE_S + 5)


def test_bad_kv_transfer_params_are_a_400_naming_the_field(pd):
    """kv_transfer_params that name no prefill instance's blocks (a wrong type, a value out of range, keys
    missing) fail the request with a 400 naming the field, in any on_transfer_failure mode; the decode engine
    goes on (before, a value of a wrong type raised in its scheduler and killed it)."""
    prefill, decode, proxy = pd
    body = {"prompt": PROMPT + " in bad shape", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    good = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    for bad, message in (({**good, "num_remote_tokens": "abc"}, "num_remote_tokens must be an integer, got 'abc'"),
                         ({**good, "remote_port": 99999}, "remote_port 99999 is not a valid TCP port"),
                         ({**good, "remote_block_ids": [[1]]}, "remote_block_ids must be block numbers >= 0"),
                         ({"do_remote_prefill": True}, "kv_transfer_params lacks remote_host, remote_port")):
        body = {"prompt": PROMPT + " in bad shape", "max_tokens": MAX_TOKENS, "kv_transfer_params": bad}
        for url in (decode.url, proxy.url):  # the proxy passes on a request that carries kv_transfer_params
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "kv_transfer_params" and message in error["message"], error
    assert httpx.get(decode.url + "/health", timeout=5).status_code == 200
    assert completion(proxy.client()) == completion(prefill.client())


def test_a_request_the_decode_instance_refuses_releases_its_lease_at_once(pd):
    """stream_options without stream passes the prefill instance (the proxy sends it neither) and is a 400 on the
    decode instance, which never pulls: the proxy has the prefill instance release the lease (its blocks stayed
    held until the lease expired)."""
    import openai

    prefill, _, proxy = pd
    expired = "expired before a decode instance pulled it"
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0, LEASE_S + 5)  # earlier tests' leases have ended
    num_expired = prefill.log().count(expired)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        completion(proxy.client(), prompt=PROMPT + " refused", stream_options={"include_usage": True})
    assert wait_for(lambda: prefill.metric(USAGE) == 0.0, LEASE_S + 5)
    assert prefill.log().count(expired) == num_expired, prefill.log()


def test_a_dead_prefill_instance_makes_the_decode_instance_recompute(pd):
    prefill, decode, _ = pd
    prompt = "Lost in transfer: " + " ".join(f"y{i}" for i in range(40))
    expected = completion(prefill.client(), prompt=prompt)
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    os.kill(prefill.engine_pid, signal.SIGKILL)  # its blocks and their server are gone before the pull
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params}
    response = httpx.post(decode.url + "/v1/completions", json=body, timeout=60).json()
    assert response["choices"][0]["text"] == expected
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here after all
    assert "KV transfer from the prefill instance at 127.0.0.1" in decode.log() and "no answer within 2 s" in decode.log()
