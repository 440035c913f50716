"""The TcpConnector's background writes, half by half: the worker writes a load's blocks and
reports it written in its step report (a mismatched layer is reported failed, the engine goes
on); the scheduler half admits a request once every rank reported its write, and turns a failure
into a local recompute or, in fail mode, the request's error."""

from __future__ import annotations

import types

import pytest
import torch

from runtime.kv_transfer import parse_transfer_config
from runtime_pd.scheduler_half import TcpConnectorScheduler
from runtime_pd.worker_half import TcpConnectorWorker


def config(mode: str = "recompute", role: str = "kv_consumer", port: int | None = None):
    transfer = {"kv_connector": "TcpConnector", "kv_role": role, "engine_id": "d",
                "kv_connector_extra_config": {"on_transfer_failure": mode}, **({"kv_port": port} if port else {})}
    cache = types.SimpleNamespace(kv_transfer_config=parse_transfer_config(transfer), block_size=4, cache_dtype="auto",
                                  kv_block_layout="")
    model = types.SimpleNamespace(architecture="LlamaForCausalLM", dtype="float32",
                                  hf_config=types.SimpleNamespace(num_hidden_layers=2))
    return types.SimpleNamespace(cache_config=cache, model_config=model)


def test_the_worker_reports_written_and_failed_loads():
    worker = TcpConnectorWorker(config())
    caches = [torch.zeros(2, 6, 4, 3) for _ in range(2)]  # [k/v, blocks, block size, width]: blocks on dim 1
    worker.register_kv_caches(caches, block_dim=1)
    assert worker.get_connector_output() is None
    blocks = [torch.arange(48.0).view(2, 2, 4, 3) + 100 * i for i in range(2)]  # two blocks of each layer
    wrong = [torch.ones(2, 2, 4, 5), torch.ones(2, 2, 4, 5)]
    metadata = types.SimpleNamespace(leases={}, unleases=[], loads=[("a", ([4, 1], blocks)), ("b", ([2, 3], wrong))])
    worker.start_load_kv(metadata)
    report = worker.get_connector_output()
    assert report["written"] == ["a"] and list(report["failed"]) == ["b"]
    assert "layer 0 blocks of the prefill instance are torch.float32 (2, 4, 5)" in report["failed"]["b"]
    for i, cache in enumerate(caches):
        by_block = cache.movedim(1, 0)
        assert torch.equal(by_block[[4, 1]], blocks[i]) and by_block[[0, 2, 3, 5]].eq(0).all()  # b wrote nothing
    assert worker.get_connector_output() is None  # each write is reported once


@pytest.mark.parametrize("mode", ["recompute", "fail"])
def test_the_scheduler_half_admits_after_every_rank_wrote(mode):
    sched = TcpConnectorScheduler(config(mode))
    try:
        sched.writing = {"a": 0, "b": 0}
        sched.pulls = {"a": "done", "b": "done"}
        sched.update_connector_output([{"written": ["a"], "failed": {}}, None])  # rank 1 not done with "a" yet
        assert sched.get_finished_loading() == (set(), {}) and sched.build_connector_meta(None).poll
        sched.update_connector_output([None, {"written": ["a"], "failed": {"b": "KV transfer failed: boom"}}])
        written, failed = sched.get_finished_loading()
        assert written == {"a"} and failed == {"b": None if mode == "recompute" else "KV transfer failed: boom"}
        assert sched.pulls["b"] == "KV transfer failed: boom" and sched.num_failed_pulls == 1  # b's lookup computes here
        assert not sched.writing and not sched.build_connector_meta(None).poll and not sched.has_pending_work()
    finally:
        sched.shutdown()


def test_the_block_server_answers_at_once_for_an_ended_lease_and_at_shutdown():
    """A pull of a lease that ended (pulled already, expired) is refused at once, not after the 5 s that a lease
    not registered yet is waited for (the server's one thread serves every pull: such a wait held them all); a
    pull still waiting at shutdown returns, so that the server thread stops before its socket closes."""
    import threading
    import time

    worker = TcpConnectorWorker(config())
    worker.register_kv_caches([torch.arange(2 * 6 * 4 * 3.0).view(2, 6, 4, 3) for _ in range(2)], block_dim=1)
    early = {}
    waiting = threading.Thread(target=lambda: early.update(reply=worker.serve_pull("late", [3], worker.layout)))
    waiting.start()  # a pull before the step that registers its lease: served once the lease comes
    worker.start_load_kv(types.SimpleNamespace(leases={"late": [3], "r": [1, 2]}, unleases=[], loads=[]))
    waiting.join(timeout=5)
    reply, layers = early["reply"]
    assert reply.error == "" and len(layers) > 0
    worker.start_load_kv(types.SimpleNamespace(leases={}, unleases=["r"], loads=[]))  # r pulled: its lease ends
    start = time.monotonic()
    reply, _ = worker.serve_pull("r", [1, 2], worker.layout)
    assert time.monotonic() - start < 1.0
    assert "the lease of request 'r' has ended" in reply.error
    pending = {}
    waiting = threading.Thread(target=lambda: pending.update(reply=worker.serve_pull("never", [0], worker.layout)))
    waiting.start()
    time.sleep(0.2)
    start = time.monotonic()
    worker.shutdown()
    waiting.join(timeout=5)
    assert time.monotonic() - start < 1.0
    assert "shutting down" in pending["reply"][0].error


def test_a_pull_of_an_unknown_lease_holds_no_other_pull():
    """A pull whose lease is not registered (never made, or its step not run yet) waits without the server's one
    thread: a pull of a leased request behind it is answered at once, and the waiting one once its lease comes."""
    import time

    import zmq
    from support.remote_server import free_port

    from runtime_pd.wire import PullRequest, decode_reply, encode

    worker = TcpConnectorWorker(config(role="kv_producer", port=free_port()))
    worker.register_kv_caches([torch.arange(2 * 6 * 4 * 3.0).view(2, 6, 4, 3) for _ in range(2)], block_dim=1)
    context = zmq.Context()
    sockets = {name: context.socket(zmq.DEALER) for name in ("unknown", "late", "leased")}
    try:
        for name, socket in sockets.items():
            socket.linger = 0
            socket.connect(f"tcp://127.0.0.1:{worker.settings.port}")
            socket.send(encode(PullRequest(name, [1], worker.layout)))
            time.sleep(0.05)  # in this order: the leased pull comes behind the two that wait
        start = time.monotonic()
        worker.start_load_kv(types.SimpleNamespace(leases={"leased": [1]}, unleases=[], loads=[]))
        assert sockets["leased"].poll(2000), "a pull of a leased request waited behind one of an unknown lease"
        assert time.monotonic() - start < 1.0 and decode_reply(sockets["leased"].recv_multipart()[0]).error == ""
        worker.start_load_kv(types.SimpleNamespace(leases={"late": [1]}, unleases=[], loads=[]))
        assert sockets["late"].poll(2000) and decode_reply(sockets["late"].recv_multipart()[0]).error == ""
        assert not sockets["unknown"].poll(0)  # still waiting for its lease
        assert sockets["unknown"].poll(8000)
        assert "no blocks are leased to request 'unknown'" in decode_reply(sockets["unknown"].recv_multipart()[0]).error
    finally:
        for socket in sockets.values():
            socket.close()
        context.term()
        worker.shutdown()
