"""Preemption always lets some request progress: no two requests take turns evicting each other forever.

The drivers below step the scheduler with a fake model (token 7 for each request that samples),
either synchronously or as the engine's async scheduling does (the next step is scheduled before
the previous one's tokens come back).
"""

import random

import pytest

from runtime.messages import ModelRunnerOutput


def _sampling(scheduler, scheduler_output) -> list[str]:
    """Requests that the step samples for (their scheduled tokens reach their known tokens)."""
    requests = scheduler.requests
    return [
        rid for rid in scheduler_output.num_scheduled_tokens
        if requests[rid].num_output_placeholders
        and requests[rid].num_computed_tokens == requests[rid].num_tokens + requests[rid].num_output_placeholders - 1
    ]


def run_until_done(scheduler, max_steps: int, overlap: bool) -> tuple[int, dict[str, str]]:
    """Steps taken (``max_steps`` when requests remain) and each finished request's finish reason."""
    reasons: dict[str, str] = {}
    in_flight = None

    def collect(step):
        so, sampled = step
        out = scheduler.update_from_output(so, ModelRunnerOutput(sampled, [[7] for _ in sampled]))
        reasons.update((o.request_id, o.finish_reason) for o in out.outputs if o.finish_reason is not None)

    for step in range(max_steps):
        if not scheduler.has_requests():
            if in_flight is not None:
                collect(in_flight)
            return step, reasons
        so = scheduler.schedule()
        launched = (so, _sampling(scheduler, so))
        if overlap:
            if in_flight is not None:
                collect(in_flight)
            in_flight = launched
        else:
            collect(launched)
    return max_steps, reasons


@pytest.mark.parametrize("overlap", [False, True])
def test_children_of_one_request_do_not_preempt_each_other_forever(make_scheduler, make_request, overlap):
    # The n children of one request share their arrival time. Both need 22 of the 24 blocks at the
    # end: with the tie, the child ahead in the running list picked itself as the victim, so each
    # recomputed its whole sequence, then gave way to the other, and neither ever finished.
    s = make_scheduler(num_blocks=24, block_size=4, budget=8, max_len=96)
    for child in ("0_x", "1_x"):
        s.add_request(make_request(child, 21, max_tokens=75, arrival=100.0))
    steps, reasons = run_until_done(s, max_steps=1000, overlap=overlap)
    assert reasons == {"0_x": "length", "1_x": "length"}, (steps, s.running, s.waiting)
    assert s.kv_cache_manager.pool.num_free_blocks == 24


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(40))
def test_random_requests_under_memory_pressure_all_finish(make_scheduler, make_request, seed, policy):
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 10, 12, 16])
    max_len = num_blocks * 4
    s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=rng.choice([4, 5, 8, 16]), max_len=max_len,
                       max_seqs=rng.choice([2, 16]), policy=policy, caching=rng.random() < 0.5)
    expected = {}
    for parent in range(rng.randrange(1, 4)):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, max_len - 1))]
        priority = rng.randrange(2)
        room = max_len - len(prompt)
        max_tokens = rng.choice([room, rng.randrange(1, room + 1)])  # often up to max_model_len
        for child in range(rng.choice([1, 2, 3])):  # n > 1: children arrive together
            rid = f"{child}_{parent}"
            s.add_request(make_request(rid, prompt, max_tokens=max_tokens, arrival=float(parent), priority=priority))
            expected[rid] = "length"
    steps, reasons = run_until_done(s, max_steps=3000, overlap=rng.random() < 0.5)
    assert reasons == expected, (steps, s.running, s.waiting)
    kv = s.kv_cache_manager
    assert kv.pool.num_free_blocks == num_blocks and not kv.req_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
