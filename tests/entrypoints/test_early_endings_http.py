"""Clients that go away leave the server as it was: over real HTTP on a loopback port, a client closes its
socket mid-stream, before the first token (queued, in prefill, waiting for its grammar), with n > 1 after
one choice finished, or while its stop string is hit; afterwards the engine reports nothing running or
waiting and no KV block in use, the front end tracks no request (AsyncLLM, output processor, metrics,
concurrency slots), and a greedy request gets the tokens it got before.

The server is ``runtime serve``'s app and AsyncLLM in a thread of the test process (its engine core in
its own process), so that the front end's state can be read (tests/support/inprocess_server.py).
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time

import httpx
import pytest

from support.inprocess_server import InProcessServer
from support.remote_server import SERVER_FLAGS, wait_for

MODEL = "tiny"
MAX_NUM_SEQS = 4
PROBE = {"model": MODEL, "prompt": [5, 17, 33, 2, 91, 40, 8], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
         "return_token_ids": True}
LONG = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
SLOW_REGEX = "(x|y){3000}z"  # compiles for seconds


@pytest.fixture(scope="module")
def server(tiny_llama):
    flags = [*SERVER_FLAGS, "--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS),
             "--max-num-batched-tokens", "8", "--max-concurrent-requests", "64"]
    srv = InProcessServer([tiny_llama, *flags])
    srv.probe_tokens = probe(srv)
    yield srv
    srv.stop()
    assert srv.error is None, srv.error


def probe(srv: InProcessServer) -> list[int]:
    return httpx.post(srv.url + "/v1/completions", json=PROBE, timeout=60).json()["choices"][0]["token_ids"]


def assert_clean(srv: InProcessServer) -> None:
    assert wait_for(srv.is_idle, 15), (srv.front_end_state(), srv.metric("runtime:num_requests_running"),
                                       srv.metric("runtime:num_requests_waiting"), srv.metric("runtime:kv_cache_usage_perc"))
    assert probe(srv) == srv.probe_tokens
    assert wait_for(srv.is_idle, 15), srv.front_end_state()


class RawRequest:
    """One POST over a plain socket, so that the test decides when the connection goes (closed with a reset)."""

    def __init__(self, srv: InProcessServer, path: str, body: dict):
        self.sock = socket.create_connection(("127.0.0.1", srv.port))
        self.sock.settimeout(60)
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def events(self) -> list[dict]:
        return [json.loads(line[5:]) for line in self.received.decode(errors="replace").split("\n")
                if line.startswith("data: {")]

    def read_until(self, done) -> None:
        """Read until ``done(events so far)``."""
        while not done(self.events()):
            chunk = self.sock.recv(65536)
            assert chunk, self.received
            self.received += chunk

    def close(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def aborted(srv: InProcessServer) -> float:
    return srv.metric("runtime:request_success_total", finished_reason="abort")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", LONG),
    ("/v1/completions", {**LONG, "prompt": ["hi", "there", "you"]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                              "stream": True, "n": 2, "temperature": 1.0}),
], ids=["completion", "three-prompts", "chat-n2"])
def test_closed_mid_stream(server, path, body):
    before = aborted(server)
    request = RawRequest(server, path, body)
    request.read_until(lambda events: any(c.get("text") or c.get("delta", {}).get("content")
                                          for e in events for c in e["choices"]))
    request.close()
    assert_clean(server)
    num_prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert aborted(server) == before + num_prompts * body.get("n", 1)


def test_closed_while_queued_and_while_in_prefill(server):
    """Every sequence slot taken by one request of n choices: the next waits in the queue, then one with a long
    prompt is admitted when the slots free up and goes away in its prefill (8 tokens a step)."""
    before = aborted(server)
    busy = RawRequest(server, "/v1/completions", {**LONG, "n": MAX_NUM_SEQS})
    busy.read_until(lambda events: len(events) > 0)
    queued = RawRequest(server, "/v1/completions", {**LONG, "prompt": "queued"})
    assert wait_for(lambda: server.metric("runtime:num_requests_waiting") == 1, 15)
    queued.close()
    assert wait_for(lambda: aborted(server) == before + 1 and server.metric("runtime:num_requests_waiting") == 0, 15)
    prefill = RawRequest(server, "/v1/completions", {**LONG, "prompt": list(range(3, 243)), "max_tokens": 10})
    assert wait_for(lambda: server.metric("runtime:num_requests_waiting") == 1, 15)
    busy.close()
    assert wait_for(lambda: server.metric("runtime:num_requests_running") == 1, 15)  # its prompt computing
    prefill.close()
    assert_clean(server)
    assert aborted(server) == before + 2 + MAX_NUM_SEQS


def test_closed_while_its_grammar_compiles(server):
    before = aborted(server)
    request = RawRequest(server, "/v1/completions", {**LONG, "structured_outputs": {"regex": SLOW_REGEX}})
    # it waits for its grammar in the engine, and /metrics says so (as vLLM's num_requests_waiting does)
    assert wait_for(lambda: server.metric("runtime:num_requests_waiting") == 1, 15)
    request.close()
    assert_clean(server)
    assert aborted(server) == before + 1


def test_closed_with_n_choices_after_one_finished(server):
    sampled = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 12, "ignore_eos": True, "n": 3, "temperature": 1.0,
               "seed": 7, "return_token_ids": True}
    choices = httpx.post(server.url + "/v1/completions", json=sampled, timeout=60).json()["choices"]
    tokens = [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]
    stop = tokens[0][2]  # ends choice 0 at its third token while the others go on
    assert all(stop not in other[:6] for other in tokens[1:]), tokens
    request = RawRequest(server, "/v1/completions", {**sampled, "max_tokens": 200, "stream": True, "stop_token_ids": [stop]})
    request.read_until(lambda events: any(c["finish_reason"] for e in events for c in e["choices"]))
    finished = [c["index"] for e in request.events() for c in e["choices"] if c["finish_reason"]]
    assert finished == [0] and server.metric("runtime:num_requests_running") > 0
    request.close()
    assert_clean(server)


def test_many_clients_gone_at_random_moments(server):
    """Stop strings hit while their clients go, unary requests given up, streams of several choices: mixed."""
    rng = random.Random(0)

    def client(body: dict, path: str, delay: float) -> None:
        request = RawRequest(server, path, body)
        time.sleep(delay)
        request.close()

    threads = []
    for i in range(10):
        body = {"model": MODEL, "max_tokens": rng.choice([2, 8, 60]), "stream": rng.random() < 0.7,
                "n": rng.choice([1, 2]), "temperature": 1.0, "seed": i, "stop": rng.choice([None, ["a"], ["e", "t"]])}
        if rng.random() < 0.3:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "x" * rng.randrange(1, 60)}]
        else:
            path, body["prompt"] = "/v1/completions", rng.choice(["hi", "x " * rng.randrange(1, 60), ["a", "b c"]])
        threads.append(threading.Thread(target=client, args=(body, path, rng.random() * 0.2)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert_clean(server)
