"""Randomized end-to-end scheduling: outputs do not depend on how requests were scheduled.

Seeded random workloads (prompts sharing prefixes, random max_tokens, n > 1) run on a tiny
random Llama under random scheduler settings (token budgets down to one block, KV caches small
enough to force preemption, prefix caching and async scheduling on or off, aborts at random
steps). Greedy tokens must equal those of a reference engine with room for everything (itself
checked against transformers), every request must finish exactly once with the right finish
reason, and once all requests are done every KV block must be free with no reference left.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime import SamplingParams
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_args import EngineArgs
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal, hf_greedy

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96  # 24 blocks: the smallest KV cache that may be configured


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_untokenized_model("llama", tmp_path_factory.mktemp("llama"))


def make_engine(model_path, **kwargs) -> LLMEngine:
    args = dict(model=model_path, dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                block_size=BLOCK_SIZE)
    return LLMEngine.from_engine_args(EngineArgs(**(args | kwargs)))


@pytest.fixture(scope="module")
def reference(model_path):
    """An engine with blocks and budget for everything: nothing is chunked or preempted."""
    return make_engine(model_path, num_gpu_blocks_override=1024, max_num_batched_tokens=4096)


def random_workload(rng: random.Random, max_prompt: int = 30, max_output: int = 30):
    """(request id, prompt token ids, params) with shared prefixes, random lengths and some n > 1."""
    prefixes = [[rng.randrange(3, UNTOKENIZED_VOCAB_SIZE) for _ in range(max_prompt // 2)] for _ in range(2)]
    requests = []
    for i in range(rng.randrange(2, 7)):
        prefix = rng.choice(prefixes)[: rng.randrange(0, max_prompt // 2 + 1)]
        prompt = prefix + [rng.randrange(3, UNTOKENIZED_VOCAB_SIZE) for _ in range(rng.randrange(1, max_prompt // 2))]
        max_tokens = rng.choice([None, rng.randrange(1, max_output)])  # None: up to max_model_len
        stop = rng.sample(range(3, UNTOKENIZED_VOCAB_SIZE), 12) if rng.random() < 0.3 else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=rng.choice([1, 1, 2, 3]),
                                stop_token_ids=stop, detokenize=False)
        requests.append((f"req-{i}", prompt, params))
    return requests


def run(engine: LLMEngine, requests, aborts: dict[int, list[str]] | None = None, max_steps: int = 4000):
    """Each request's final completions, [(token ids, finish reason)] by index; asserts that each
    request finishes once and reports nothing after that."""
    aborts = aborts or {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished: dict[str, list[tuple[list[int], str]]] = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        engine.abort_request(aborts.get(step, []))
        for output in engine.step():
            assert output.request_id not in finished, f"{output.request_id} reported after it finished"
            if output.finished:
                finished[output.request_id] = [(list(c.token_ids), c.finish_reason) for c in output.outputs]
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {engine.engine_core.scheduler.requests}")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not kv.req_blocks and not kv.num_cached_blocks
    assert kv.pool.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.pool.num_free_blocks} blocks leaked"
    assert [b for b in kv.pool.blocks if b.ref_cnt] == []
    assert engine.engine_core.in_flight is None
    stats = scheduler.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0)


def expected_finish(prompt, params, tokens) -> str:
    """The finish reason the completion ``tokens`` must have (stop tokens come only from stop_token_ids)."""
    stops = set(params.stop_token_ids or ())
    assert not stops.intersection(tokens[:-1])
    if tokens[-1] in stops:
        return "stop"
    room = MAX_MODEL_LEN - len(prompt)
    assert len(tokens) == min(params.max_tokens or room, room)
    return "length"


def test_reference_engine_matches_transformers(model_path, reference):
    from transformers import AutoModelForCausalLM

    requests = random_workload(random.Random(1234))
    requests = [(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False))
                for rid, prompt, _ in requests]
    ours = run(reference, requests)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    hf = hf_greedy(model, [prompt for _, prompt, _ in requests], max_new_tokens=12)
    check_outputs_equal([tokens for tokens, _ in hf], [ours[rid][0][0] for rid, _, _ in requests], "reference engine")
    assert_all_blocks_free(reference)


@pytest.mark.parametrize("seed", range(6))
def test_random_scheduling_gives_the_reference_tokens(model_path, reference, seed):
    rng = random.Random(seed)
    requests = random_workload(rng)
    expected = run(reference, requests)
    for request_id, prompt, params in requests:
        assert len(expected[request_id]) == params.n
        for tokens, reason in expected[request_id]:
            assert reason == expected_finish(prompt, params, tokens)
    settings = dict(
        num_gpu_blocks_override=rng.choice([24, 26, 32]),  # 24 blocks hold one max_model_len sequence
        max_num_batched_tokens=rng.choice([BLOCK_SIZE, 5, 8, 16, 256]),
        max_num_seqs=rng.choice([1, 2, 4, 16]),
        enable_prefix_caching=seed % 2 == 0,
        async_scheduling=seed % 3 != 0,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
    )
    engine = make_engine(model_path, **settings)
    assert run(engine, requests) == expected, settings
    assert_all_blocks_free(engine)

    # The same workload again (the prefix cache is warm now), with aborts at random steps.
    aborts: dict[int, list[str]] = {}
    for request_id, _, _ in requests:
        if rng.random() < 0.5:
            aborts.setdefault(rng.randrange(0, 40), []).append(request_id)
    got = run(engine, requests, aborts)
    aborted = {request_id for ids in aborts.values() for request_id in ids}
    assert set(expected) - set(got) <= aborted, "a request that was not aborted never finished"
    for request_id, completions in got.items():
        for (tokens, reason), (want_tokens, want_reason) in zip(completions, expected[request_id], strict=True):
            if reason == "abort":
                assert request_id in aborted and tokens == want_tokens[: len(tokens)]
            else:
                assert (tokens, reason) == (want_tokens, want_reason), (request_id, settings)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_children_of_one_request_finish_under_memory_pressure(model_path, reference, async_scheduling):
    # n=2 children share their arrival time, and two of them need 22 of the 24 blocks at the end.
    # The tie made the child ahead preempt itself whenever it needed a block, so the two took
    # turns recomputing their sequences and never finished (with async scheduling).
    rng = random.Random(5)
    requests = [
        (name, [rng.randrange(3, UNTOKENIZED_VOCAB_SIZE) for _ in range(length)],
         SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, n=2, detokenize=False))
        for name, length in (("a", 66), ("b", 21))
    ]
    expected = run(reference, requests)
    engine = make_engine(model_path, num_gpu_blocks_override=24, max_num_batched_tokens=8,
                         enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert run(engine, requests, max_steps=600) == expected
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("ended_by", ["abort", "stop"])
def test_request_id_reused_while_its_last_step_is_in_flight(model_path, reference, ended_by):
    # With async scheduling the step after the one that ended a request (or after its abort) is
    # already queued with a token for it. A new request under the same id used to receive that token
    # as its first output.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    old, new = [21, 22, 23, 24, 25], [40, 41, 42, 43, 44, 45]
    expected = run(reference, [("x", new, params)])
    free_run = run(reference, [("x", old, params)])["x"][0][0]
    engine = make_engine(model_path, async_scheduling=True)
    stop_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False,
                                 stop_token_ids=[free_run[2]])
    engine.add_request("x", {"prompt_token_ids": old}, params if ended_by == "abort" else stop_params)
    engine.add_request("y", {"prompt_token_ids": [7, 8, 9]}, params)
    for _ in range(50):
        outputs = {output.request_id: output for output in engine.step()}
        if ended_by == "abort" and engine.engine_core.num_steps_ahead >= 2:
            engine.abort_request(["x"])
            break
        if "x" in outputs and outputs["x"].finished:
            assert outputs["x"].outputs[0].token_ids == free_run[: free_run.index(free_run[2]) + 1]
            break
    assert engine.engine_core.in_flight is not None
    assert "x" in engine.engine_core.in_flight.scheduler_output.num_scheduled_tokens
    assert run(engine, [("x", new, params)])["x"] == expected["x"]
    assert_all_blocks_free(engine)


def test_prompts_too_long_are_refused_naming_the_lengths(model_path):
    engine = make_engine(model_path, num_gpu_blocks_override=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, detokenize=False)
    for length in (MAX_MODEL_LEN, MAX_MODEL_LEN + 50):
        with pytest.raises(ValueError, match=f"prompt has {length} tokens, but max_model_len is {MAX_MODEL_LEN}"):
            engine.add_request("long", {"prompt_token_ids": [5] * length}, params)
    assert not engine.has_unfinished_requests()
    # The longest prompt that fits runs in a KV cache of exactly max_model_len tokens.
    finished = run(engine, [("longest", [5] * (MAX_MODEL_LEN - 1), params)])
    assert [(len(tokens), reason) for tokens, reason in finished["longest"]] == [(1, "length")]
    assert_all_blocks_free(engine)


def test_kv_cache_smaller_than_max_model_len_is_refused(model_path):
    with pytest.raises(ValueError, match=r"holds 23 blocks x 4 = 92 tokens, fewer than max_model_len \(96\)"):
        make_engine(model_path, num_gpu_blocks_override=23)
