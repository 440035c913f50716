"""The scheduler's remote-KV wait (prefill/decode), with connectors defined here: a request
whose lookup answers "loads asynchronously" waits holding no blocks while others run, is
admitted with the remote tokens counted computed once the connector names it, fails with the
connector's reason in fail mode, is dropped cleanly when aborted while waiting; a finished
request's blocks are held until the connector names it as sent. A load in the background holds
the request's blocks (out of the prefix cache) but no step, until the connector names it done;
aborted meanwhile, its blocks wait for the load; failed, it computes its prompt or fails."""

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


class BackgroundConnector(RemoteConnector):
    """Writes its tokens while steps run without the request; ``loading_ended`` and
    ``loading_failed`` are what the next get_finished_loading call returns."""

    def __init__(self, remote=None):
        super().__init__(remote)
        self.arrived = set(self.remote)  # pulled already: the lookup counts them at once
        self.loading_ended: set[str] = set()
        self.loading_failed: dict[str, str | None] = {}
        self.dropped: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.dropped:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def loads_in_background(self, request):
        return True

    def get_finished_loading(self):
        ended, failed = self.loading_ended, self.loading_failed
        self.loading_ended, self.loading_failed = set(), {}
        self.dropped.update(failed)
        return ended, failed


def test_a_background_load_holds_its_blocks_but_no_step():
    connector = BackgroundConnector({"d": 12})
    sched = scheduler(connector)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.add_request(make_request("local", list(range(20, 26))))
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"local": 6}  # the steps go on without it
    assert len(kv.block_ids("d")) == 3 and output.kv_connector_metadata.loads == [("d", 12)]  # its 12 tokens, no more
    assert sched.stats()["num_waiting_for_remote_kv"] == 1 and sched.get_num_unfinished_requests() == 2
    # The blocks being written are not in the prefix cache: a request with the same prompt misses them.
    twin = make_request("twin", list(range(1, 14)))
    assert kv.get_computed_blocks(twin) == ([], 0)
    run(sched, output)
    assert sched.schedule().num_scheduled_tokens == {"local": 1}  # still loading
    connector.loading_ended = {"d"}
    output = sched.schedule()
    assert output.num_scheduled_tokens["d"] == 1  # only the tail
    new = output.scheduled_new_reqs[0]
    assert (new.req_id, new.num_computed_tokens) == ("d", 12) and new.block_ids == kv.block_ids("d")
    assert len(new.block_ids) == 4 and sched.requests["d"].num_cached_tokens == 12
    assert kv.get_computed_blocks(twin)[1] == 12  # loaded, so indexed now


def test_an_abort_while_loading_in_the_background_keeps_the_blocks_until_the_load_ends():
    connector = BackgroundConnector({"d": 12})
    sched = scheduler(connector, num_blocks=8)
    pool = sched.kv_cache_manager.pool
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.schedule()
    block_ids = sched.kv_cache_manager.block_ids("d")
    assert pool.num_free_blocks == 8 - 3
    assert [r.status for r in sched.finish_requests(["d"])] == [RequestStatus.FINISHED_ABORTED]
    assert connector.finished == [("d", block_ids)]
    assert sched.has_requests() and sched.get_num_unfinished_requests() == 0
    sched.schedule()
    assert pool.num_free_blocks == 8 - 3  # the copy may still write them
    connector.loading_ended = {"d"}
    assert sched.schedule().is_empty
    assert pool.num_free_blocks == 8 and not sched.has_requests()


def test_a_failed_background_load_computes_the_prompt_here():
    connector = BackgroundConnector({"d": 12})
    sched = scheduler(connector, num_blocks=8)
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.schedule()
    connector.loading_failed = {"d": None}
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"d": 13}  # the whole prompt, in fresh blocks
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0 and sched.kv_cache_manager.pool.num_free_blocks == 8 - 4


def test_a_failed_background_load_fails_the_request_in_fail_mode():
    connector = BackgroundConnector({"d": 12})
    sched = scheduler(connector, num_blocks=8)
    sched.add_request(make_request("d", list(range(1, 14))))
    sched.schedule()
    connector.loading_failed = {"d": "KV transfer failed: layer 0 differs"}
    outputs = run(sched, sched.schedule())
    assert outputs.failed == {"d": "KV transfer failed: layer 0 differs"}
    assert sched.kv_cache_manager.pool.num_free_blocks == 8 and not sched.has_requests()
