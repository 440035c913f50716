"""Issue 16 (data parallel): the replica choice, and a DPEngineCoreClient over fake engine clients."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from runtime.engine.core_client import EngineDeadError, EngineStartupError, RequestFailure
from runtime.engine.dp_client import DPEngineCoreClient, choose_replica
from runtime.engine.dp_placement import ReplicaPlacement, visible_devices
from runtime.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from runtime.metrics import EngineMetrics, combine_engine_stats
from runtime.sampling_params import SamplingParams


def test_choose_replica_takes_the_fewest_unfinished():
    assert choose_replica([3, 1, 2], start=0) == 1
    assert choose_replica([0, 5], start=1) == 0


def test_choose_replica_breaks_ties_round_robin():
    assert [choose_replica([2, 2, 2], start) for start in range(4)] == [0, 1, 2, 0]
    assert choose_replica([1, 4, 1], start=1) == 2  # the first tied replica at or after start


class FakeClient:
    def __init__(self, fail_ready: str | None = None):
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.fail_ready = fail_ready

    async def wait_ready(self, timeout_s):
        if self.fail_ready:
            raise EngineStartupError(self.fail_ready)
        return {"num_blocks": 8}

    async def get_output(self):
        message = await self.outputs.get()
        if isinstance(message, BaseException):
            raise message
        return message

    def add_request(self, request):
        self.added.append(request.request_id)

    def abort_requests(self, request_ids):
        self.aborted.extend(request_ids)

    def shutdown(self):
        pass


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


def finished(request_id: str) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [7], finish_reason=FinishReason.LENGTH)])


def test_requests_balance_aborts_follow_and_outputs_merge():
    async def main():
        clients = [FakeClient(), FakeClient()]
        dp = DPEngineCoreClient(clients)
        assert (await dp.wait_ready(5.0))["num_blocks"] == 8
        for name in "abc":
            dp.add_request(request(name))
        assert (clients[0].added, clients[1].added, dp.num_unfinished) == (["a", "c"], ["b"], [2, 1])
        clients[0].outputs.put_nowait(finished("a"))
        assert await dp.get_indexed_output() == (0, finished("a"))
        assert dp.num_unfinished == [1, 1]
        dp.add_request(request("d"))  # a tie: round-robin goes on after the last choice (replica 0)
        assert clients[1].added == ["b", "d"]
        dp.abort_requests(["c", "d", "a"])  # "a" finished already: dropped
        assert (clients[0].aborted, clients[1].aborted, dp.num_unfinished) == (["c"], ["d"], [0, 1])
        clients[1].outputs.put_nowait(RequestFailure("b", "bad grammar"))
        assert await dp.get_indexed_output() == (1, RequestFailure("b", "bad grammar"))
        assert dp.num_unfinished == [0, 0]
        clients[1].outputs.put_nowait(EngineDeadError("the engine process exited unexpectedly (exit code -9)"))
        with pytest.raises(EngineDeadError, match="data-parallel rank 1: the engine process exited"):
            await dp.get_indexed_output()
        assert dp.is_dead
        with pytest.raises(EngineDeadError):
            dp.add_request(request("e"))
        await dp.stop_reading()

    asyncio.run(main())


def test_startup_failure_names_the_rank():
    async def main():
        dp = DPEngineCoreClient([FakeClient(), FakeClient(fail_ready="no such model")])
        with pytest.raises(EngineStartupError, match="data-parallel rank 1: no such model"):
            await dp.wait_ready(5.0)

    asyncio.run(main())


def test_combined_stats_sum_counts_and_average_the_cache():
    combined = combine_engine_stats([
        {"num_running": 2, "kv_cache_usage": 0.5, "prefix_cache_hits": 3, "spec_decode_num_accepted_tokens_per_pos": [1]},
        {"num_running": 1, "kv_cache_usage": 0.1, "prefix_cache_hits": 4, "spec_decode_num_accepted_tokens_per_pos": [2, 5]},
    ])
    assert combined == {
        "num_running": 3, "kv_cache_usage": pytest.approx(0.3), "prefix_cache_hits": 7,
        "spec_decode_num_accepted_tokens_per_pos": [3, 5],
    }


def test_metrics_per_engine_and_for_the_server():
    metrics = EngineMetrics("m")
    metrics.add_request("a", 3)
    metrics.record(EngineCoreOutputs(scheduler_stats={"num_running": 2, "kv_cache_usage": 0.5, "prefix_cache_hits": 3,
                                                      "prefix_cache_queries": 4}), engine_index=0)
    metrics.record(EngineCoreOutputs(scheduler_stats={"num_running": 1, "kv_cache_usage": 0.25, "prefix_cache_hits": 1,
                                                      "prefix_cache_queries": 4}), engine_index=1)
    metrics.record(finished("a"), engine_index=1)
    text = metrics.render().decode()
    assert 'runtime:num_requests_running{model_name="m"} 3.0' in text
    assert 'runtime:kv_cache_usage_perc{model_name="m"} 0.375' in text
    assert 'runtime:prefix_cache_hits_total{model_name="m"} 4.0' in text
    assert 'runtime:engine_num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'runtime:engine_num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert 'runtime:engine_request_success_total{engine="1",finished_reason="length",model_name="m"} 1.0' in text
    assert 'runtime:engine_request_success_total{engine="0",finished_reason' not in text


def test_gpu_replicas_take_their_share_of_the_visible_devices(monkeypatch):
    monkeypatch.setenv("SIM_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_devices(("SIM_VISIBLE_DEVICES",), 4, device_count=4) == ("SIM_VISIBLE_DEVICES", ["4", "5", "6", "7"])
    with pytest.raises(ValueError, match="needs 6 devices; 4 visible"):
        visible_devices(("SIM_VISIBLE_DEVICES",), 6, device_count=4)
    monkeypatch.delenv("SIM_VISIBLE_DEVICES")
    assert visible_devices(("SIM_VISIBLE_DEVICES",), 2, device_count=3) == ("SIM_VISIBLE_DEVICES", ["0", "1", "2"])
    ReplicaPlacement(1, env=(("SIM_VISIBLE_DEVICES", "2,3"),)).apply()
    assert os.environ.pop("SIM_VISIBLE_DEVICES") == "2,3"


def test_offline_llm_refuses_data_parallel():
    from runtime import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2: .*--data-parallel-size N"):
        LLM("no-model-is-loaded", data_parallel_size=2)


def two_replicas_on(platform: str) -> SimpleNamespace:
    """The part of an EngineConfig that replica_placements reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=2, world_size=1), device_config=SimpleNamespace(platform=platform),
    )


def test_cpu_replicas_share_the_cores():
    from runtime.engine.dp_placement import replica_placements
    from runtime.engine_args import EngineArgs

    (args0, place0), (args1, place1) = replica_placements(EngineArgs.from_kwargs(model="m"), two_replicas_on("cpu"))
    cores = sorted(os.sched_getaffinity(0))
    share = max(len(cores) // 2, 1)
    assert args0.cpu_num_threads == args1.cpu_num_threads == share
    assert (place0.rank, place1.rank) == (0, 1) and not place0.env
    if len(cores) >= 2:
        assert place0.cpu_cores == tuple(cores[:share]) and place1.cpu_cores == tuple(cores[share:2 * share])


@pytest.mark.parametrize("given", [{"kv_port": 18790}, {}, '{"kv_port": 18790}'])
def test_each_replica_serves_kv_transfers_on_its_own_ports(given):
    """A P/D connector binds kv_port and kv_port + 1 in each replica's engine: replica r takes kv_port + 2 r (the
    default port when none is given; a JSON string as well), else every replica but one fails to start."""
    import json

    from runtime.engine.dp_placement import DEFAULT_KV_PORT, replica_placements
    from runtime.engine_args import EngineArgs

    transfer = {"kv_connector": "TcpConnector", "kv_role": "kv_producer"}
    raw = ('{"kv_connector": "TcpConnector", "kv_role": "kv_producer", ' + given[1:]) if isinstance(given, str) else {**transfer, **given}
    base = 18790 if given else DEFAULT_KV_PORT
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=3, world_size=1),
                             device_config=SimpleNamespace(platform="cpu"))
    placements = replica_placements(EngineArgs.from_kwargs(model="m", kv_transfer_config=raw), config)
    assert placements[0][0].kv_transfer_config == raw  # rank 0 as given
    for rank, (args, _) in enumerate(placements[1:], start=1):
        assert args.kv_transfer_config == {**transfer, "kv_port": base + 2 * rank}
    assert json.loads(json.dumps(placements[2][0].kv_transfer_config))["kv_role"] == "kv_producer"
    (args, _), _ = replica_placements(EngineArgs.from_kwargs(model="m"), two_replicas_on("cpu"))
    assert args.kv_transfer_config is None


def test_the_placement_environment_is_set_around_the_spawn_only(monkeypatch):
    monkeypatch.setenv("SIM_VISIBLE_DEVICES", "0,1,2,3")
    placement = ReplicaPlacement(1, env=(("SIM_VISIBLE_DEVICES", "2,3"), ("SIM_OTHER", "x")))
    with placement.environment():
        assert (os.environ["SIM_VISIBLE_DEVICES"], os.environ["SIM_OTHER"]) == ("2,3", "x")
    assert os.environ["SIM_VISIBLE_DEVICES"] == "0,1,2,3" and "SIM_OTHER" not in os.environ


def test_shutdown_stops_every_replica():
    clients = [FakeClient(), FakeClient()]
    stopped = []
    for client in clients:
        client.shutdown = lambda client=client: stopped.append(client)
    DPEngineCoreClient(clients).shutdown()
    assert sorted(map(id, stopped)) == sorted(map(id, clients))


def test_a_gpu_platform_without_a_devices_variable_is_refused(monkeypatch):
    from runtime.engine import dp_placement
    from runtime.engine_args import EngineArgs

    gpu = SimpleNamespace(name="npu", device_type="npu", visible_devices_envs=(), device_count=lambda: 2)
    monkeypatch.setattr("runtime.platforms.select_platform", lambda name: gpu)
    config = two_replicas_on("npu")
    with pytest.raises(ValueError, match="platform 'npu' names no visible-devices variable"):
        dp_placement.replica_placements(EngineArgs.from_kwargs(model="m"), config)
    gpu.visible_devices_envs = ("NPU_VISIBLE_DEVICES",)
    monkeypatch.setenv("NPU_VISIBLE_DEVICES", "3,5")
    placements = dp_placement.replica_placements(EngineArgs.from_kwargs(model="m"), config)
    assert [p.env for _, p in placements] == [(("NPU_VISIBLE_DEVICES", "3"),), (("NPU_VISIBLE_DEVICES", "5"),)]


def test_a_failing_reader_is_the_death_of_the_engine():
    async def main():
        clients = [FakeClient(), FakeClient()]
        dp = DPEngineCoreClient(clients)
        await dp.wait_ready(5.0)
        clients[0].outputs.put_nowait(AssertionError("unexpected engine message b'X'"))
        with pytest.raises(EngineDeadError, match="rank 0: reading its outputs failed: AssertionError"):
            await dp.get_indexed_output()
        await dp.stop_reading()

    asyncio.run(main())


def test_a_replica_that_just_died_is_seen_at_once_and_named(tmp_path):
    """/health asks ``probe_death``: it looks at the processes now, where the readers notice a death only at
    their next poll (with two API processes, the one a /health lands on may not have polled yet)."""
    import subprocess

    from runtime.engine import core_proc
    from runtime.engine.core_client import EngineCoreClient

    addresses = core_proc.EngineCoreAddresses.in_dir(str(tmp_path), 2)
    engines = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    clients = [EngineCoreClient.attach(addresses, index, engine.pid) for index, engine in enumerate(engines)]
    dp = DPEngineCoreClient(clients)
    try:
        assert dp.probe_death() is None and not dp.is_dead
        engines[1].kill()
        engines[1].wait()
        assert dp.probe_death() == "data-parallel rank 1: the engine process exited unexpectedly (pid %d is gone)" % engines[1].pid
        assert dp.is_dead and clients[1].is_dead and not clients[0].is_dead
    finally:
        engines[0].kill()
        for client in clients:
            client.shutdown()
