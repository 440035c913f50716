"""Speculative decoding in the scheduler: drafts from the token budget and the KV cache,
rollback of rejected drafts, stops inside an accepted run, per-token logprobs rows, and
no speculative position ever in the prefix cache."""

from __future__ import annotations

from runtime.messages import LogprobsLists, ModelRunnerOutput
from runtime.scheduler.request import RequestStatus


def prefill(scheduler, token=7):
    """Run steps until every request decodes (one token each, ``token``)."""
    while any(r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids for r in scheduler.requests.values()):
        so = scheduler.schedule()
        sampled = [rid for rid in so.num_scheduled_tokens if scheduler.requests[rid].num_output_placeholders]
        scheduler.update_from_output(so, ModelRunnerOutput(sampled, [[token] for _ in sampled]))


def step(scheduler, emitted: dict[str, list[int]], logprobs=False):
    """Schedule, then return ``emitted[req_id]`` as the tokens of each scheduled request."""
    so = scheduler.schedule()
    req_ids = [rid for rid in so.num_scheduled_tokens if rid in emitted]
    tokens = [emitted[rid] for rid in req_ids]
    lp = None
    if logprobs:  # row i names its token and carries -i as its logprob
        rows = [t for ts in tokens for t in ts]
        lp = LogprobsLists([[t] for t in rows], [[-float(i)] for i in range(len(rows))], [1] * len(rows))
    return so, scheduler.update_from_output(so, ModelRunnerOutput(req_ids, tokens, lp))


def test_drafts_are_scheduled_with_the_real_token_and_rejected_ones_roll_back(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("a", 6, max_tokens=20))
    prefill(s)
    request = s.requests["a"]
    assert (request.num_tokens, request.num_computed_tokens) == (7, 6)
    request.spec_token_ids = [11, 12, 13]
    so, out = step(s, {"a": [11, 12, 99]})  # two drafts accepted, the third replaced by 99
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert out.outputs[0].new_token_ids == [11, 12, 99]
    assert request.spec_token_ids == []
    # 6 + 4 computed, minus the rejected draft: the newest token (99) is the next input.
    assert (request.num_tokens, request.num_computed_tokens) == (10, 9)
    assert out.scheduler_stats["spec_decode_num_drafts"] == 1
    assert out.scheduler_stats["spec_decode_num_draft_tokens"] == 3
    assert out.scheduler_stats["spec_decode_num_accepted_tokens"] == 2
    assert out.scheduler_stats["spec_decode_num_accepted_tokens_per_pos"] == [1, 1]
    so, _ = step(s, {"a": [5]})  # no drafts: a plain decode
    assert so.num_scheduled_tokens == {"a": 1} and so.scheduled_spec_decode_tokens == {}


def test_short_budget_schedules_fewer_drafts_and_keeps_a_token_for_every_running_request(make_scheduler, make_request):
    s = make_scheduler(budget=6)
    for rid in "abc":
        s.add_request(make_request(rid, 2, max_tokens=20))
    prefill(s)
    s.requests["a"].spec_token_ids = [1, 2, 3, 4, 5]
    s.requests["b"].spec_token_ids = [1, 2, 3]
    so, _ = step(s, {"a": [1, 2], "b": [9], "c": [9]})
    # a: 6 - 2 (b and c behind it) = 4 tokens, 3 drafts; b: what is left, 1 token, no drafts.
    assert so.num_scheduled_tokens == {"a": 4, "b": 1, "c": 1}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert s.requests["a"].num_computed_tokens == s.requests["a"].num_tokens - 1


def test_stop_inside_an_accepted_run_ends_the_request_there(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("eos", 3, max_tokens=20))
    s.add_request(make_request("stop", 3, max_tokens=20, stop_token_ids=[42]))
    s.add_request(make_request("len", 3, max_tokens=3))
    s.add_request(make_request("min", 3, max_tokens=20, min_tokens=3))
    prefill(s)
    for request in s.requests.values():
        request.spec_token_ids = [1, 2, 3]
    emitted = {"eos": [1, 0, 3, 4], "stop": [1, 42, 3, 4], "len": [1, 2, 3, 4], "min": [0, 3, 0, 4]}
    _, out = step(s, emitted)
    got = {o.request_id: (o.new_token_ids, o.finish_reason) for o in out.outputs}
    assert got["eos"] == ([1, 0], "stop")
    assert got["stop"] == ([1, 42], "stop")
    assert got["len"] == ([1, 2], "length")  # 1 (prefill) + 2 = max_tokens
    assert got["min"] == ([0, 3, 0], "stop")  # EOS stops only once min_tokens is reached
    assert not s.requests


def test_logprobs_rows_follow_the_emitted_tokens(make_scheduler, make_request):
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=20, logprobs=1))
    s.add_request(make_request("b", 3, max_tokens=20, logprobs=1, stop_token_ids=[8]))
    s.add_request(make_request("c", 3, max_tokens=20, logprobs=1))
    prefill(s)
    s.requests["a"].spec_token_ids = [4, 5]
    s.requests["b"].spec_token_ids = [8, 9]
    _, out = step(s, {"a": [4, 5, 6], "b": [8, 9, 1], "c": [3]}, logprobs=True)
    got = {o.request_id: (o.new_token_ids, o.new_logprobs.token_ids, o.new_logprobs.logprobs) for o in out.outputs}
    assert got["a"] == ([4, 5, 6], [[4], [5], [6]], [[-0.0], [-1.0], [-2.0]])
    assert got["b"] == ([8], [[8]], [[-3.0]])  # stopped at its first token: one row
    assert got["c"] == ([3], [[3]], [[-6.0]])


def test_drafts_never_enter_the_prefix_cache(make_scheduler, make_request):
    s = make_scheduler(block_size=4, caching=True)
    s.add_request(make_request("a", 6, max_tokens=20))
    prefill(s)
    request = s.requests["a"]  # 7 known tokens, 6 computed
    request.spec_token_ids = [50, 51, 52, 53, 54]  # positions 7..11 reach into a third block
    so, _ = step(s, {"a": [50, 9]})
    assert so.scheduled_spec_decode_tokens == {"a": [50, 51, 52, 53, 54]}
    kv = s.kv_cache_manager
    # Only the first block was full of known tokens when the step was scheduled.
    assert [b.block_hash is not None for b in kv.req_blocks["a"]] == [True, False, False]
    assert (request.num_tokens, request.num_computed_tokens) == (9, 8)
    # The block that held rejected drafts is cached only once real tokens fill it and are computed.
    for token in (1, 2, 3):
        step(s, {"a": [token]})
    assert [b.block_hash for b in kv.req_blocks["a"]] == request.block_hashes[:2] + [None]
    step(s, {"a": [4]})
    assert [b.block_hash for b in kv.req_blocks["a"]] == request.block_hashes[:3]
    assert request.all_token_ids[8:12] == [9, 1, 2, 3]


def test_drafts_are_dropped_before_anything_is_preempted_and_by_preemption(make_scheduler, make_request):
    # 4 blocks of 4 tokens: a and b hold two each, so a's drafts find no free block.
    s = make_scheduler(num_blocks=4, block_size=4, max_len=64)
    s.add_request(make_request("a", 6, max_tokens=20))
    s.add_request(make_request("b", 6, max_tokens=20))
    prefill(s)
    s.requests["a"].spec_token_ids = [1, 2, 3]
    so, _ = step(s, {"a": [5], "b": [5]})
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    assert s.num_preemptions == 0
    # A preempted request loses its drafts.
    s.requests["b"].spec_token_ids = [1, 2]
    victim = s._preempt_one(0)
    assert victim.status == RequestStatus.PREEMPTED and victim.spec_token_ids == []
