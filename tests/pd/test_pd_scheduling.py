"""The scheduler's remote-KV wait (prefill/decode), with a connector defined here: a request
whose lookup answers "loads asynchronously" waits holding no blocks while others run, is
admitted with the remote tokens counted computed once the connector names it, fails with the
connector's reason in fail mode, is dropped cleanly when aborted while waiting; a finished
request's blocks are held until the connector names it as sent."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_transfer import KVConnectorMetadata
from runtime.messages import ModelRunnerOutput
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.scheduler import Scheduler

BLOCK = 4


@dataclass
class Meta(KVConnectorMetadata):
    loads: list = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads


class RemoteConnector:
    """Requests named in ``remote`` (id -> tokens) load from afar; ``recving`` and ``sending``
    are what the next get_finished_* calls return."""

    def __init__(self, remote=None):
        self.remote = dict(remote or {})
        self.arrived: set[str] = set()
        self.recving: dict[str, str | None] = {}
        self.sending: set[str] = set()
        self.finished: list[tuple[str, list[int]]] = []
        self.meta = Meta()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id not in self.remote:
            return 0, False
        if request.request_id not in self.arrived:
            return 0, True
        return self.remote[request.request_id] - num_computed_tokens, False

    def get_finished_recving(self):
        ended, self.recving = self.recving, {}
        self.arrived.update(r for r, why in ended.items() if why is None)
        return ended

    def get_finished_sending(self):
        ended, self.sending = self.sending, set()
        return ended

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.meta.loads.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        meta, self.meta = self.meta, Meta()
        return meta

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return request.request_id.startswith("prefill"), {"from": request.request_id}


def make_request(req_id, prompt, max_tokens=4) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0}))


def scheduler(connector, num_blocks=16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, CacheConfig(block_size=BLOCK, enable_prefix_caching=True), num_blocks, kv_connector=connector)


def run(sched, output, token=5):
    req_ids = [r for r in output.num_scheduled_tokens if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
    return sched.update_from_output(output, ModelRunnerOutput(req_ids, [[token] for _ in req_ids]))


def test_a_remote_request_waits_without_blocks_while_others_run():
    connector = RemoteConnector({"d": 12})
    sched = scheduler(connector)
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.add_request(make_request("local", list(range(20, 26))))
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"local": 6}  # not blocked behind the remote one
    assert sched.kv_cache_manager.block_ids("d") == [] and "d" in sched.kv_connector.waiting_remote
    assert sched.has_requests() and sched.get_num_unfinished_requests() == 2
    assert sched.stats()["num_waiting_for_remote_kv"] == 1
    run(sched, output)
    connector.recving = {"d": None}
    output = sched.schedule()
    assert output.num_scheduled_tokens["d"] == 1  # only the tail: 12 of 13 prompt tokens came from afar
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert output.kv_connector_metadata.loads == [("d", 12)]
    assert sched.requests["d"].num_cached_tokens == 12
    assert sched.kv_cache_manager.stats.queries == 6 + 13  # each prompt looked up once


def test_a_failed_remote_load_fails_the_request_with_the_reason():
    connector = RemoteConnector({"d": 12})
    sched = scheduler(connector)
    sched.add_request(make_request("d", list(range(1, 14))))
    run(sched, sched.schedule())
    connector.recving = {"d": "KV transfer failed: no answer within 1 s"}
    outputs = run(sched, sched.schedule())
    assert outputs.failed == {"d": "KV transfer failed: no answer within 1 s"}
    assert not sched.has_requests() and connector.finished == [("d", [])]


def test_an_abort_while_waiting_for_remote_kv_cleans_up():
    connector = RemoteConnector({"d": 12})
    sched = scheduler(connector)
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.schedule()
    ended = sched.finish_requests(["d"])
    assert [r.status for r in ended] == [RequestStatus.FINISHED_ABORTED]
    assert connector.finished == [("d", [])] and not sched.kv_connector.waiting_remote and not sched.has_requests()
    connector.recving = {"d": None}  # its load ends later: ignored
    assert sched.schedule().is_empty


def test_a_finished_prefills_blocks_are_held_until_sent():
    connector = RemoteConnector()
    sched = scheduler(connector, num_blocks=8)
    sched.add_request(make_request("prefill-1", list(range(1, 14)), max_tokens=1))
    outputs = run(sched, sched.schedule())
    assert outputs.outputs[0].kv_transfer_params == {"from": "prefill-1"}
    assert sched.kv_cache_manager.pool.num_free_blocks == 8 - 4  # held past the finish
    for _ in range(3):
        sched.schedule()  # steps go by: still held (no step-based release for this connector)
    assert sched.kv_cache_manager.pool.num_free_blocks == 8 - 4
    connector.sending = {"prefill-1"}
    sched.schedule()
    assert sched.kv_cache_manager.pool.num_free_blocks == 8 and sched.kv_cache_manager.usage() == 0.0
