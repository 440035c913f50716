"""The token-budget scheduler: budget, chunking, preemption, priority, stops, abort."""

from runtime.messages import ModelRunnerOutput
from runtime.scheduler.request import RequestStatus

from support.engine_outputs import step_records


def run_step(scheduler, token=7):
    """Schedule, pretend the model sampled ``token`` for every finished prefill/decode; returns the
    scheduler output and every request's output record."""
    so = scheduler.schedule()
    sampled = [
        rid
        for rid in so.num_scheduled_tokens
        if scheduler.requests[rid].num_output_placeholders  # schedule() marked it to sample
    ]
    out = scheduler.update_from_output(so, ModelRunnerOutput(sampled, [[token] for _ in sampled]))
    return so, step_records(so, out)


def test_budget_is_shared_and_prefill_is_chunked(make_scheduler, make_request):
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}
    assert so.total_num_scheduled_tokens == 16
    so, out = run_step(s)
    # a decodes one token, b finishes its prefill with the remaining 4
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert {o.request_id for o in out} == {"a", "b"}


def test_max_num_seqs_limits_running(make_scheduler, make_request):
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 4))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"0", "1"}
    assert len(s.waiting) == 1


def test_no_chunking_when_disabled(make_scheduler, make_request):
    s = make_scheduler(budget=16, max_seqs=8, max_len=16, chunked_prefill=False)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10}


def test_max_tokens_and_eos_and_stop_token_ids(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("len", 4, max_tokens=2))
    s.add_request(make_request("stop", 4, max_tokens=10, stop_token_ids=[7]))
    _, out = run_step(s, token=7)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in out}
    assert reasons["stop"] == ("stop", 7)
    assert reasons["len"] == (None, None)
    _, out = run_step(s, token=7)
    assert [(o.request_id, o.finish_reason) for o in out] == [("len", "length")]
    assert not s.has_requests()


def test_eos_respects_min_tokens_and_ignore_eos(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("min", 4, max_tokens=5, min_tokens=2))
    s.add_request(make_request("ign", 4, max_tokens=3, ignore_eos=True))
    _, out = run_step(s, token=0)
    assert all(o.finish_reason is None for o in out)
    _, out = run_step(s, token=0)
    assert {o.request_id: o.finish_reason for o in out} == {"min": "stop", "ign": None}
    _, out = run_step(s, token=0)
    assert [(o.request_id, o.finish_reason) for o in out] == [("ign", "length")]


def test_preemption_frees_blocks_and_resumes_by_recompute(make_scheduler, make_request):
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens each grow until they collide.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_len=64)
    s.add_request(make_request("a", 8, max_tokens=12))
    s.add_request(make_request("b", 8, max_tokens=12))
    seen_preempt = False
    finished = set()
    for _ in range(60):
        so, out = run_step(s)
        if so.finished_req_ids - finished:
            seen_preempt = True
        finished |= {o.request_id for o in out if o.finished}
        if not s.has_requests():
            break
    assert seen_preempt and s.num_preemptions > 0
    assert finished == {"a", "b"}
    assert s.kv_cache_manager.pool.num_free_blocks == 6


def test_preempted_request_is_resent_with_its_outputs(make_scheduler, make_request):
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, max_len=64)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 4, max_tokens=8))
    resumed = None
    for _ in range(40):
        so, _ = run_step(s)
        for new in so.scheduled_new_reqs:
            if new.output_token_ids:
                resumed = new
        if resumed or not s.has_requests():
            break
    assert resumed is not None
    assert resumed.num_computed_tokens == 0 and resumed.output_token_ids == [7] * len(resumed.output_token_ids)


def test_priority_policy_orders_waiting_and_preempts_lowest(make_scheduler, make_request):
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add_request(make_request("low", 4, priority=5, arrival=1.0))
    s.add_request(make_request("high", 4, priority=0, arrival=2.0))
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["high"]


def test_fcfs_orders_by_arrival(make_scheduler, make_request):
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("first", 4, priority=5, arrival=1.0))
    s.add_request(make_request("second", 4, priority=0, arrival=2.0))
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["first"]


def test_abort_frees_blocks_and_tells_workers(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("a", 8, max_tokens=100))
    s.add_request(make_request("b", 8, max_tokens=100))
    run_step(s)
    ended = s.finish_requests(["a", "unknown"])
    assert [r.request_id for r in ended] == ["a"] and ended[0].status == RequestStatus.FINISHED_ABORTED
    so, _ = run_step(s)
    assert "a" in so.finished_req_ids and list(so.num_scheduled_tokens) == ["b"]
    s.finish_requests(["b"])
    assert not s.has_requests() and s.kv_cache_manager.pool.num_free_blocks == 64


def test_prefix_cache_hit_counts_cached_tokens(make_scheduler, make_request):
    s = make_scheduler(caching=True)
    s.add_request(make_request("a", 12, max_tokens=1))
    run_step(s)
    s.add_request(make_request("b", 12, max_tokens=1))
    so, out = run_step(s)
    assert so.num_scheduled_tokens == {"b": 4} and so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out[0].num_cached_tokens == 8


def test_priority_policy_preempts_the_lowest_priority_running_request(make_scheduler, make_request):
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, policy="priority", max_len=64)
    s.add_request(make_request("low", 4, max_tokens=8, priority=9, arrival=1.0))
    s.add_request(make_request("high", 4, max_tokens=8, priority=0, arrival=2.0))
    preempted = []
    for _ in range(6):
        so, _ = run_step(s)
        preempted += [r for r in so.finished_req_ids if s.requests.get(r) and s.requests[r].status == RequestStatus.PREEMPTED]
        if preempted:
            break
    assert preempted == ["low"]


def test_eos_that_is_also_a_stop_token_id_reports_no_stop_reason(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("eos", 4, max_tokens=10, stop_token_ids=[0]))
    s.add_request(make_request("ign", 4, max_tokens=10, stop_token_ids=[0], ignore_eos=True))
    s.add_request(make_request("min", 4, max_tokens=10, stop_token_ids=[0], min_tokens=2))
    _, out = run_step(s, token=0)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in out}
    # EOS wins over the same id in stop_token_ids; under ignore_eos the stop id still ends it.
    assert reasons == {"eos": ("stop", None), "ign": ("stop", 0), "min": (None, None)}
    _, out = run_step(s, token=0)
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in out] == [("min", "stop", None)]


def test_prefix_cache_stats_count_a_request_waiting_for_blocks_once(make_scheduler, make_request):
    s = make_scheduler(num_blocks=5, block_size=4, caching=True)
    s.add_request(make_request("a", 17, max_tokens=3))  # holds all 5 blocks until it ends
    s.add_request(make_request("b", list(range(1, 9)) + [40, 41], max_tokens=1))  # hits a's first 2 blocks
    for _ in range(3):
        so, _ = run_step(s)
        assert "b" not in so.num_scheduled_tokens  # looked up, no block for its tail
    so, _ = run_step(s)
    assert so.scheduled_new_reqs[0].req_id == "b" and so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert (s.kv_cache_manager.stats.queries, s.kv_cache_manager.stats.hits) == (17 + 10, 8)
