"""The decode fast paths of the Scheduler: identical to the general paths, step by step.

``schedule`` skips ``KVCacheManager.allocate_slots`` for a running request whose next
token lands inside its last block; ``update_from_output`` sends a plain one-token output
as a column entry (``EngineCoreOutputs.new_tokens``) instead of a record. The reference is
the same scheduler with both switched off (``no_op_decode_offsets`` emptied, every update
down the general path), run on the same workload with a fake model whose token at each
position depends only on the request and the position.
"""

from __future__ import annotations

import random
import zlib

import pytest

from runtime.sampling_params import SamplingParams
from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.messages import LogprobsLists, ModelRunnerOutput
from runtime.scheduler.request import Request
from runtime.scheduler.scheduler import Scheduler

from support.engine_outputs import step_records

EOS = 0
VOCAB = 50


def fake_token(token_ids: list[int]) -> int:
    """The 'sampled' token: a function of the sequence so far, as a real model's greedy pick is."""
    return zlib.crc32(str(token_ids[-4:] + [len(token_ids)]).encode()) % VOCAB


def continuation(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt) :]


def make_workload(seed: int, num_requests: int) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs: shared prefixes, varied lengths, EOS and stop ids.

    Some prompts repeat an earlier prompt followed by the tokens it generates, so they
    hit blocks the earlier request filled while decoding (when prefix caching is on).
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(10)]
    prompts: list[list[int]] = []
    workload = []
    for i in range(num_requests):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 14))]
        if i % 3 == 2:
            earlier = rng.choice(prompts)
            prompt = earlier + continuation(earlier, rng.randrange(1, 12))
        else:
            prompt = (prefix[: rng.randrange(0, 11)] + own) if i % 2 else own
        prompts.append(prompt)
        max_tokens = rng.randrange(1, 30)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.choice([0, 0, 3]), max_tokens),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else None,
        )
        request = Request(f"r{i}", prompt, params, eos_token_ids=frozenset({EOS}), arrival_time=float(i))
        workload.append((rng.randrange(0, 12), request))
    return workload


def clone(request: Request) -> Request:
    return Request(
        request.request_id, request.prompt_token_ids, request.sampling_params,
        eos_token_ids=request.eos_token_ids, arrival_time=request.arrival_time,
    )


def count_allocate_calls(scheduler: Scheduler) -> list[int]:
    calls = [0]
    kv = scheduler.kv_cache_manager
    original = kv.allocate_slots

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    kv.allocate_slots = counted
    return calls


def step_record(scheduler: Scheduler) -> tuple:
    """One step (schedule, fake model, update) as plain data to compare."""
    so = scheduler.schedule()
    new = [(r.req_id, r.block_ids, r.num_computed_tokens, r.output_token_ids) for r in so.scheduled_new_reqs]
    c = so.scheduled_cached_reqs
    cached = (c.req_ids, c.num_computed_tokens, c.new_block_ids)
    sampled = [
        req_id
        for req_id in so.num_scheduled_tokens
        if scheduler.requests[req_id].num_output_placeholders  # schedule() marked it to sample
    ]
    tokens = [[fake_token(scheduler.requests[req_id].all_token_ids)] for req_id in sampled]
    first = {req_id for req_id in sampled if not scheduler.requests[req_id].output_token_ids}
    runner_output = ModelRunnerOutput(sampled, tokens)
    if scheduler.kv_cache_manager.no_op_decode_offsets == range(0):  # the reference: the general update path too
        runner_output.prompt_logprobs = {"(no request)": LogprobsLists([], [], [])}  # selects it, matches no request
    out = scheduler.update_from_output(so, runner_output)
    # A first token goes as a record: it carries num_cached_tokens, which the columns do not.
    assert out.new_tokens is None or not first.intersection(out.new_tokens.request_ids)
    outputs = [
        (o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.num_cached_tokens if o.request_id in first else None)
        for o in step_records(so, out)
    ]
    return list(so.num_scheduled_tokens.items()), new, cached, sorted(so.finished_req_ids), outputs


def assert_blocks_cover_computed_tokens(scheduler: Scheduler) -> None:
    """The invariant the fast path rests on: ceil(num_computed_tokens / block_size) blocks."""
    kv = scheduler.kv_cache_manager
    for request in scheduler.running:
        expected = -(-request.num_computed_tokens // kv.block_size)
        assert len(kv.req_blocks[request.request_id]) == expected, request


def run_both(make_scheduler, workload, abort_at: dict[int, str], **kwargs) -> tuple[Scheduler, Scheduler, int, int]:
    kwargs.update(max_seqs=8, max_len=64)
    fast, general = make_scheduler(fast_decode=True, **kwargs), make_scheduler(fast_decode=False, **kwargs)
    fast_calls, general_calls = count_allocate_calls(fast), count_allocate_calls(general)
    for step in range(400):
        for scheduler in (fast, general):
            for _, request in (w for w in workload if w[0] == step):
                scheduler.add_request(clone(request))
            if step in abort_at:
                scheduler.finish_requests([abort_at[step]])
        assert step_record(fast) == step_record(general), f"step {step}"
        assert_blocks_cover_computed_tokens(general)
        if step > 12 and not fast.has_requests():
            break
    assert not fast.has_requests() and not general.has_requests()
    return fast, general, fast_calls[0], general_calls[0]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize(
    "num_blocks,block_size,budget",
    [
        (256, 4, 64),  # plenty of blocks
        (256, 16, 64),
        (256, 1, 64),  # every decode token needs a new block: the fast path never applies
        (20, 4, 64),  # blocks run out: preemption
        (256, 4, 7),  # small budget: chunked prefills next to decodes
    ],
)
def test_fast_path_matches_general_path(make_scheduler, caching, num_blocks, block_size, budget):
    workload = make_workload(seed=num_blocks + block_size + budget, num_requests=14)
    fast, general, fast_calls, general_calls = run_both(
        make_scheduler, workload, {9: "r3"}, num_blocks=num_blocks, block_size=block_size, caching=caching, budget=budget
    )
    assert fast.num_preemptions == general.num_preemptions
    assert fast.kv_cache_manager.stats == general.kv_cache_manager.stats
    assert fast.kv_cache_manager.pool.num_free_blocks == num_blocks
    if block_size > 2:
        assert fast_calls < general_calls  # the fast path did skip allocate_slots
    if num_blocks == 20:
        assert fast.num_preemptions > 0


def test_preemption_when_decodes_run_out_of_blocks(make_scheduler):
    # 4 requests of 4 prompt tokens decode in lockstep; 8 blocks of 4 hold 32 tokens.
    fast, general = (make_scheduler(8, 4, caching=False, budget=64, max_seqs=8, max_len=64, fast_decode=f) for f in (True, False))
    for scheduler in (fast, general):
        for i in range(4):
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            scheduler.add_request(Request(f"r{i}", [1 + i] * 4, params, arrival_time=float(i)))
    preempted = []
    for step in range(100):
        record = step_record(fast)
        assert record == step_record(general), f"step {step}"
        preempted += record[3]  # finished_req_ids: preempted (none ends before its 12 tokens)
        if not fast.has_requests():
            break
    assert fast.num_preemptions > 0 and preempted
    assert fast.kv_cache_manager.pool.num_free_blocks == 8


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 2, 4, 5])
def test_allocate_slots_is_a_no_op_at_the_fast_path_offsets(caching, block_size):
    """What the fast path skips, allocate_slots would not have done: no block, no index entry."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size, enable_caching=caching)
    request = Request("a", list(range(1, 8)), SamplingParams(max_tokens=40))
    assert kv.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    for token in range(3 * block_size + 2):
        request.append_output_token(100 + token)
        offset_is_no_op = request.num_computed_tokens % block_size in kv.no_op_decode_offsets
        before = (kv.pool.num_free_blocks, dict(kv.pool.cached), dict(kv.num_cached_blocks), len(kv.req_blocks["a"]))
        new_blocks = kv.allocate_slots(request, 1)
        after = (kv.pool.num_free_blocks, dict(kv.pool.cached), dict(kv.num_cached_blocks), len(kv.req_blocks["a"]))
        if offset_is_no_op:
            assert new_blocks == [] and before == after
        request.num_computed_tokens += 1


def test_block_filled_by_the_last_decode_token_is_cached(make_scheduler):
    """A decode token that fills a block takes the general path, so the block is indexed
    even when the request finishes in that same step (4-token blocks)."""
    results = []
    for fast in (True, False):
        scheduler = make_scheduler(16, 4, caching=True, budget=64, max_seqs=8, max_len=64, fast_decode=fast)
        a = Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        scheduler.add_request(a)
        step_record(scheduler)  # prefill 3 tokens, sample t1
        step_record(scheduler)  # decode t1 into position 3 (fills block 0), sample t2: finished
        assert not scheduler.has_requests()
        scheduler.add_request(Request("b", a.all_token_ids[:4] + [9], SamplingParams(max_tokens=1)))
        so = scheduler.schedule()
        results.append((so.scheduled_new_reqs[0].num_computed_tokens, so.num_scheduled_tokens))
    assert results[0] == results[1] == (4, {"b": 1})
