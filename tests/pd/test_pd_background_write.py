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


def config(mode: str = "recompute"):
    transfer = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "engine_id": "d",
                "kv_connector_extra_config": {"on_transfer_failure": mode}}
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
