"""Issue 16 (data parallel): ``runtime serve -dp 2`` runs two engine cores behind one front end.

Concurrent requests land on both replicas (the per-engine series of /metrics say so) and give
the tokens of one engine; streaming works; a disconnect aborts the request in its replica; the
death of one replica fails the requests in flight, turns /health unhealthy and stops the server
with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest

from support.remote_server import SERVER_FLAGS, RemoteServer, wait_for

DP_FLAGS = SERVER_FLAGS + ["--data-parallel-size", "2", "--served-model-name", "tiny"]
PROMPTS = [f"The number {i} is" for i in range(8)]
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=[1, 2], ids=["1api", "2api"])
def dp_server(request, tiny_llama, tmp_path_factory):
    """One server per API process count (starting its processes takes long on two cores); the last test
    kills one of its replicas, which ends it. With two API processes each balances its own requests."""
    flags = DP_FLAGS + ["--api-server-count", str(request.param)]
    srv = RemoteServer(tiny_llama, flags, tmp_path_factory.mktemp("dp") / "server.log").wait_ready()
    yield srv
    srv.stop()


def engine_pids(server: RemoteServer) -> dict[int, int]:
    """Data-parallel rank -> pid of its engine core process, from the server's log."""
    found = re.findall(r"engine core process started \(pid (\d+)\) for data-parallel rank (\d+)", server.log())
    return {int(rank): int(pid) for pid, rank in found}


def per_engine(server: RemoteServer, name: str, **labels) -> dict[str, float]:
    samples = server.metrics()
    return {engine: samples.get((name, tuple(sorted({**labels, "engine": engine}.items()))), 0.0) for engine in "01"}


def one_engine_texts(model: str) -> list[str]:
    from runtime import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=256, num_gpu_blocks_override=512)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [output.outputs[0].text for output in outputs]


def test_two_engine_processes_start(dp_server):
    pids = engine_pids(dp_server)
    assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2, dp_server.log()[-3000:]
    assert "[engine dp0]" in dp_server.log() and "[engine dp1]" in dp_server.log()


def test_concurrent_requests_use_both_engines_and_match_one_engine(dp_server, tiny_llama):
    before = per_engine(dp_server, "runtime:engine_request_success_total", finished_reason="length")

    async def complete_all():
        async with dp_server.async_client() as client:
            return await asyncio.gather(*(
                client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                for p in PROMPTS
            ))

    served = [r.choices[0].text for r in asyncio.run(complete_all())]
    after = per_engine(dp_server, "runtime:engine_request_success_total", finished_reason="length")
    done = {engine: after[engine] - before[engine] for engine in after}
    assert done["0"] > 0 and done["1"] > 0 and done["0"] + done["1"] == len(PROMPTS), done
    assert served == one_engine_texts(tiny_llama)
    assert dp_server.metric("runtime:request_success_total", finished_reason="length") >= len(PROMPTS)
    assert wait_for(lambda: dp_server.metric("runtime:num_requests_running") == 0)


def test_streaming_matches_the_whole_answer(dp_server):
    client = dp_server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    chunks = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def stream_events(server: RemoteServer, events: list, read_timeout_s: float = 30.0) -> None:
    """Read a streamed completion into ``events`` until it ends, the server goes or a read times out."""
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": 8, "temperature": 0.0, "stream": True}
    try:
        timeout = httpx.Timeout(30.0, read=read_timeout_s)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                events.append(f"HTTP {response.status_code}: {response.read().decode()}")
            events.extend(line for line in response.iter_lines() if line.startswith("data:"))
    except httpx.HTTPError as exc:
        events.append(type(exc).__name__)


def stream_on_frozen_replica(server: RemoteServer, rank: int, read_timeout_s: float) -> tuple[threading.Thread, list]:
    """Freeze replica ``rank`` (SIGSTOP) and start streams until one is stuck there: an API process sends its
    first to either replica and, if that one finishes (on the other), its next to ``rank`` (a tie goes
    round-robin); of three streams, two reach the same API process. The stuck stream's reader and events."""
    os.kill(engine_pids(server)[rank], signal.SIGSTOP)
    for _ in range(3):
        events: list = []
        reader = threading.Thread(target=stream_events, args=(server, events, read_timeout_s), daemon=True)
        reader.start()
        reader.join(2.0)
        if reader.is_alive() or events[-1:] != ["data: [DONE]"]:
            return reader, events
    raise AssertionError("no stream went to the frozen replica")


def test_disconnect_aborts_in_the_replica_that_has_the_request(dp_server):
    """A stream stuck on a frozen replica is dropped by its client (a read timeout). The abort must reach that
    replica: thawed, it finds the request added and aborted, and never schedules it (a replica that got
    only the request would run it, looking its prompt up in the prefix cache)."""
    aborts = dp_server.metric("runtime:request_success_total", finished_reason="abort")
    reader, events = stream_on_frozen_replica(dp_server, 1, read_timeout_s=1.5)
    reader.join(10.0)
    assert events == ["ReadTimeout"], events
    assert wait_for(lambda: dp_server.metric("runtime:request_success_total", finished_reason="abort") == aborts + 1)
    queries = dp_server.metric("runtime:prefix_cache_queries_total")
    os.kill(engine_pids(dp_server)[1], signal.SIGCONT)
    time.sleep(1.5)  # the thawed replica reads its input at once
    assert dp_server.metric("runtime:prefix_cache_queries_total") == queries
    assert set(per_engine(dp_server, "runtime:engine_num_requests_running").values()) == {0.0}
    assert dp_server.metric("runtime:num_requests_running") == 0
    client = dp_server.client()  # both replicas serve again
    texts = {client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0.0).choices[0].text
             for _ in range(2)}
    assert len(texts) == 1


def test_a_dead_replica_fails_requests_and_stops_the_server(dp_server):
    """Runs last: it ends the module's server."""
    server = dp_server
    reader, events = stream_on_frozen_replica(server, 1, read_timeout_s=60.0)
    killed_at = time.monotonic()
    os.kill(engine_pids(server)[1], signal.SIGKILL)
    reader.join(10.0)
    assert not reader.is_alive() and time.monotonic() - killed_at < 5.0, "the request hangs after the death"
    assert len(events) == 1 and events[0].startswith("HTTP 503: ") and "data-parallel rank 1" in events[0], events
    assert "the engine process exited unexpectedly" in events[0], events
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and "data-parallel rank 1" in health.text, health.text
    server.proc.wait(30)
    assert server.proc.returncode == 1, server.log()[-3000:]
    other = engine_pids(server)[0]
    assert wait_for(lambda: not os.path.exists(f"/proc/{other}"), 10.0), "the other replica outlived the server"
