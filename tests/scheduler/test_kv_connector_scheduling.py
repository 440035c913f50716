"""The scheduler's calls into a KV connector (offload tiers), with a connector defined here:
tier tokens allocated and counted as computed after the device prefix hit, loads in the
step's metadata, finished requests' blocks held until that step is back, swap preemption
and device evictions reported, reservations dropped when no blocks are allocated."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_transfer import KVConnectorMetadata, KVConnectorScheduler
from runtime.messages import ModelRunnerOutput
from runtime.scheduler.scheduler import Scheduler

BLOCK = 4


@dataclass
class Meta(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves)


class TierConnector:
    """A tier holding ``tier`` (block hashes); records every call."""

    def __init__(self, tier=(), delay_free=True):
        self.tier = set(tier)
        self.delay_free = delay_free
        self.calls: list[tuple] = []
        self.meta = Meta()
        self.evicted: list[tuple[int, bytes]] = []
        self.preempted: list[tuple[str, list[int]]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first, found = num_computed_tokens // BLOCK, 0
        for block_hash in request.block_hashes[first : (request.num_tokens - 1) // BLOCK]:
            if block_hash not in self.tier:
                break
            found += 1
        self.calls.append(("lookup", request.request_id, num_computed_tokens, found))
        return found * BLOCK, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, list(block_ids), num_external_tokens))
        if num_external_tokens:
            self.meta.loads.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        meta, self.meta = self.meta, Meta()
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        if self.delay_free:
            self.meta.saves.extend(block_ids)
        return self.delay_free, None

    def request_preempted(self, request, block_ids):
        self.preempted.append((request.request_id, list(block_ids)))

    def block_evicted(self, block_id, block_hash):
        self.evicted.append((block_id, block_hash))


def scheduler(connector, num_blocks=16, budget=64, mode="recompute") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode)
    return Scheduler(config, CacheConfig(block_size=BLOCK, enable_prefix_caching=True), num_blocks, kv_connector=connector)


def hashes_of(sched, make_request, prompt):
    """The block hashes the scheduler computes for ``prompt`` (via a throwaway request)."""
    request = make_request("probe", prompt)
    sched.kv_cache_manager._update_block_hashes(request)
    return request.block_hashes


def finish(sched, output):
    """Every scheduled request samples EOS (token 0) and finishes."""
    req_ids = list(output.num_scheduled_tokens)
    return sched.update_from_output(output, ModelRunnerOutput(req_ids, [[0] for _ in req_ids]))


def test_tier_tokens_are_allocated_loaded_and_counted_computed(make_request):
    probe = scheduler(TierConnector())
    prompt = list(range(1, 14))  # 13 tokens: at most 3 blocks may come from elsewhere
    connector = TierConnector(hashes_of(probe, make_request, prompt))
    sched = scheduler(connector)
    assert isinstance(connector, KVConnectorScheduler)
    sched.add_request(make_request("a", prompt))
    output = sched.schedule()
    assert connector.calls[0] == ("lookup", "a", 0, 3)
    assert connector.calls[1] == ("alloc", "a", sched.kv_cache_manager.block_ids("a"), 12)
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12 and len(output.scheduled_new_reqs[0].block_ids) == 4
    assert output.kv_connector_metadata.loads == [("a", 12)]
    assert sched.stats()["kv_offload_hit_tokens"] == 12


def test_the_tier_is_asked_past_the_device_prefix_hit(make_request):
    prompt = list(range(1, 14))
    connector = TierConnector(delay_free=False)
    sched = scheduler(connector)
    connector.tier = set(hashes_of(sched, make_request, prompt)[2:])
    sched.add_request(make_request("a", prompt[:9] + [99, 98, 97, 96]))  # shares 2 blocks with the prompt
    finish(sched, sched.schedule())
    sched.add_request(make_request("b", prompt))
    output = sched.schedule()
    assert connector.calls[-2] == ("lookup", "b", 8, 1)  # 2 blocks on the device, the third in the tier
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert output.kv_connector_metadata.loads == [("b", 4)]


def test_finished_requests_blocks_are_held_until_their_save_step_is_back(make_request):
    connector = TierConnector()
    sched = scheduler(connector, num_blocks=8)
    sched.add_request(make_request("a", 10))
    finish(sched, sched.schedule())
    assert connector.calls[-1][0] == "finished"
    pool = sched.kv_cache_manager.pool
    assert pool.num_free_blocks == 5 and sched.has_requests()  # 3 blocks held, a step must carry their saves
    save_step = sched.schedule()
    assert save_step.is_empty and save_step.kv_connector_metadata.saves == connector.calls[-1][2]
    assert pool.num_free_blocks == 5
    sched.update_from_output(save_step, ModelRunnerOutput([], []))
    assert pool.num_free_blocks == 8 and not sched.has_requests()


def test_swap_preemption_reports_the_victims_blocks(make_request):
    for mode in ("recompute", "swap"):
        connector = TierConnector(delay_free=False)
        sched = scheduler(connector, num_blocks=6, mode=mode)
        sched.add_request(make_request("old", 11, max_tokens=20))
        sched.add_request(make_request("new", [100 + i for i in range(11)], max_tokens=20))
        output = sched.schedule()
        blocks = sched.kv_cache_manager.block_ids("new")
        for _ in range(3):  # decode until the pool runs out and "new" is preempted
            req_ids = list(output.num_scheduled_tokens)
            sched.update_from_output(output, ModelRunnerOutput(req_ids, [[5] for _ in req_ids]))
            output = sched.schedule()
        assert sched.num_preemptions == 1
        assert connector.preempted == ([("new", blocks)] if mode == "swap" else [])


def test_evicted_cached_blocks_are_reported(make_request):
    connector = TierConnector(delay_free=False)
    sched = scheduler(connector, num_blocks=4)
    sched.add_request(make_request("a", 9))
    finish(sched, sched.schedule())
    hashes = set(hashes_of(sched, make_request, list(range(1, 10))))
    sched.add_request(make_request("b", [50 + i for i in range(13)]))
    sched.schedule()
    assert {h for _, h in connector.evicted} == hashes and len(connector.evicted) == 2


def test_reservations_are_dropped_when_no_blocks_are_allocated(make_request):
    prompt = list(range(1, 30))
    probe = scheduler(TierConnector())
    connector = TierConnector(hashes_of(probe, make_request, prompt))
    sched = scheduler(connector, num_blocks=4)  # too few blocks for the request
    sched.add_request(make_request("a", prompt))
    output = sched.schedule()
    assert output.is_empty and connector.calls[-1] == ("alloc", "a", [], 0)
