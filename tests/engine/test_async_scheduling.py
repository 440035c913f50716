"""Async scheduling: the next step is queued before the current one's tokens are back.

Outputs must be exactly those of the synchronous engine: stops that end a request while
its next step is already queued, aborts in flight, requests whose sampling needs their
own outputs on the host (the engine drains for them), and no step wasted on a request
whose token in flight is its last.
"""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.engine_args import EngineArgs
from runtime.engine.llm_engine import LLMEngine

from runtime.testing.models import build_tiny_model

PROMPTS = [[101, 2045, 7, 880, 42], [9001, 15, 15, 300], [77, 78, 79, 80, 81, 82, 83], [5000, 12]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engines(model_path):
    kwargs = dict(dtype="float32", max_model_len=128, block_size=4)
    return LLM(model_path, **kwargs), LLM(model_path, async_scheduling=True, **kwargs)


def generate(llm: LLM, params) -> list[tuple[list[int], str]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


def test_stop_token_ends_requests_with_a_step_in_flight(engines):
    sync, overlapped = engines
    free = generate(sync, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = free[0][0][5]  # a token the first prompt produces at position 5
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    expected = generate(sync, params)
    assert expected[0] == (free[0][0][:6], "stop")
    ahead_before = overlapped.llm_engine.engine_core.num_steps_ahead
    assert generate(overlapped, params) == expected
    assert overlapped.llm_engine.engine_core.num_steps_ahead > ahead_before


def test_requests_that_need_host_outputs_drain_the_pipeline(engines):
    sync, overlapped = engines
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    core = overlapped.llm_engine.engine_core
    ahead_before = core.num_steps_ahead
    assert generate(overlapped, params) == generate(sync, params)
    assert core.num_steps_ahead == ahead_before  # never ahead while such requests run
    assert core.scheduler.can_schedule_ahead()  # and the count is back to zero


def test_abort_while_a_step_is_in_flight(model_path):
    def run(async_scheduling: bool) -> dict[str, list[int]]:
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=model_path, dtype="float32", max_model_len=128, block_size=4, async_scheduling=async_scheduling)
        )
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 4:
                engine.abort_request(["1"])
        return done

    sync, overlapped = run(False), run(True)
    assert "1" not in overlapped and set(overlapped) == {"0", "2", "3"}
    assert overlapped == {k: v for k, v in sync.items() if k != "1"}


def test_no_step_is_spent_past_max_tokens(model_path):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model_path, dtype="float32", max_model_len=128, block_size=4, async_scheduling=True)
    )
    scheduled: dict[str, int] = {}
    executor = engine.engine_core.executor
    launch = executor.execute_model_async

    def counting(so):
        for req_id, n in so.num_scheduled_tokens.items():
            scheduled[req_id] = scheduled.get(req_id, 0) + n
        return launch(so)

    executor.execute_model_async = counting
    max_tokens = [3, 7, 1, 12]
    for i, (prompt, n) in enumerate(zip(PROMPTS, max_tokens)):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    # The prompt, then one token per output but the last (sampled, never fed back).
    assert scheduled == {str(i): len(p) + n - 1 for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))}
