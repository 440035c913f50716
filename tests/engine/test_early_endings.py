"""Every way a request can end early leaves the engine as it was: all KV blocks free, no request in any
queue of the scheduler, no grammar compile, offload pin or connector state left, nothing tracked by the
front end; and the next request gets the same greedy tokens as on a fresh engine.

Aborted while preempted (recompute or swapped to the cpu tier), between two chunks of its prompt, right
after its blocks were loaded
from the cpu tier, after its blocks came back from the disk tier but before it was looked up again,
while its grammar compiles, with n > 1 after one choice finished, with speculative decoding, with its
last token in the step in flight, finished by a stop string in the front end, failed in the step
that brings another request's last token, or failed with others in one step.
"""

from __future__ import annotations

import time

import pytest

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_args import EngineArgs
from runtime.sampling_params import SamplingParams, StructuredOutputsParams
from runtime.scheduler.request import RequestStatus
from runtime.testing.models import build_tiny_model
from support.remote_server import sharpen, wait_for

BASE = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=64)
SMALL_POOL = dict(max_model_len=32, num_gpu_blocks_override=8, max_num_batched_tokens=16)  # two long requests do not fit
PROBE = {"prompt_token_ids": [5, 17, 33, 2, 91, 40, 8, 77, 12]}
LONG = [{"prompt_token_ids": list(range(3, 14))}, {"prompt_token_ids": list(range(40, 51))}]
SWAP = dict(preemption_mode="swap", kv_offload="cpu", kv_offload_size="1MiB", enable_prefix_caching=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SLOW_REGEX = "(x|y){3000}z"  # compiles for seconds


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("early_endings"))
    sharpen(path)
    return path


def make_engine(model_path: str, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model_path, **{**BASE, **kwargs}))


def run(engine: LLMEngine, requests: dict, on_step=None, max_steps: int = 500) -> dict[str, list]:
    """Add ``{id: (prompt, params)}``, step until nothing is left; ``on_step(engine)`` after each step.
    Returns each finished request's completions' token ids."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [list(c.token_ids) for c in output.outputs]
        if on_step is not None:
            on_step(engine)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {engine.engine_core.scheduler.requests}")


def engine_state(engine: LLMEngine) -> dict:
    """What the engine still holds of requests (all empty, and every block free, when nothing runs)."""
    core = engine.engine_core
    scheduler = core.scheduler
    kv = scheduler.kv_cache_manager
    state = {
        "used_blocks": kv.num_blocks - kv.pool.num_free_blocks,
        "requests": list(scheduler.requests), "waiting": list(scheduler.waiting), "running": list(scheduler.running),
        "waiting_for_grammar": list(scheduler.waiting_for_grammar), "req_blocks": list(kv.req_blocks),
        "num_cached_blocks": list(kv.num_cached_blocks), "num_not_ahead": scheduler.num_not_ahead,
        "step_in_flight": core.in_flight is not None, "output_states": list(engine.output_processor.request_states),
        "parents": list(engine.output_processor.parent_requests),
    }
    structured = scheduler.structured_output
    if structured is not None:
        state["compile_waiters"] = len(structured._waiters)
        state["compile_handles"] = len(structured._handles)
        state["compiles_running"] = len(structured._sandbox._busy) if structured._sandbox is not None else 0
    connector = scheduler.kv_connector
    if connector is not None:
        for name in ("unsent", "in_flight", "waiting_remote", "held", "loading", "loaded", "held_loading"):
            state["connector." + name] = len(getattr(connector, name))
        offload = connector.connector
        for name in ("lookups", "waiting", "promoting", "loaded", "held", "pending"):
            state["offload." + name] = len(getattr(offload, name))
        state["offload.pins"] = sum(offload.index.pins.values())
        state["offload.unready"] = len(offload.index.unready)
    return state


def settle(engine: LLMEngine) -> None:
    """Run the steps an idle engine still takes (a step in flight, KV saves to the offload tiers)."""
    for _ in range(10):
        if not engine.has_unfinished_requests():
            return
        assert engine.step() == []


def assert_clean(engine: LLMEngine, probe_tokens: list[int]) -> None:
    """Nothing left of the requests that ended, and a new request gets the fresh engine's tokens."""
    assert_nothing_left(engine)
    assert run(engine, {"probe": (PROBE, greedy())})["probe"] == [probe_tokens]
    assert_nothing_left(engine)


def assert_nothing_left(engine: LLMEngine) -> None:
    settle(engine)
    leftover = {name: value for name, value in engine_state(engine).items() if value}
    assert not leftover


@pytest.fixture(scope="module")
def plain(model_path) -> LLMEngine:
    """One engine for the tests that need no setting of their own (each leaves it clean)."""
    return make_engine(model_path)


@pytest.fixture(scope="module")
def probe_tokens(plain) -> list[int]:
    return run(plain, {"probe": (PROBE, greedy())})["probe"][0]


@pytest.fixture(scope="module")
def constrained(model_path) -> LLMEngine:
    return make_engine(model_path, guided_decoding_backend="outlines")


@pytest.fixture(scope="module")
def swap(model_path) -> LLMEngine:
    return make_engine(model_path, **SMALL_POOL, **SWAP)


def abort_first_preempted(aborted: list[str]):
    def on_step(engine):
        preempted = [r.request_id for r in engine.engine_core.scheduler.waiting if r.status == RequestStatus.PREEMPTED]
        if preempted and not aborted:
            aborted.append(preempted[0])
            engine.abort_request(preempted[:1])
    return on_step


@pytest.mark.parametrize("settings", [{}, dict(async_scheduling=True), "swap"], ids=["recompute", "recompute-async", "swap"])
def test_abort_while_preempted(model_path, probe_tokens, settings, request):
    engine = request.getfixturevalue("swap") if settings == "swap" else make_engine(model_path, **SMALL_POOL, **settings)
    aborted: list[str] = []
    done = run(engine, {f"long{i}": (prompt, greedy(12)) for i, prompt in enumerate(LONG)}, abort_first_preempted(aborted))
    assert len(aborted) == 1 and set(done) == {"long0", "long1"} - set(aborted)
    assert_clean(engine, probe_tokens)


def test_abort_in_its_prefill(swap, plain, probe_tokens):
    """Aborted between two chunks of its prompt: the blocks computed so far (in the prefix cache, saved to the
    cpu tier) serve the next request with that prompt."""
    prompt = {"prompt_token_ids": list(range(3, 31))}
    expected = run(plain, {"reference": (prompt, greedy(2))})["reference"]
    swap.add_request("chunked", prompt, greedy(2))
    swap.step()
    request = swap.engine_core.scheduler.requests["chunked"]
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    swap.abort_request(["chunked"])
    assert_clean(swap, probe_tokens)

    def hits():
        stats = swap.engine_core.scheduler.stats()
        return stats["prefix_cache_hits"] + stats["kv_offload_hit_tokens"]

    before = hits()
    assert run(swap, {"again": (prompt, greedy(2))})["again"] == expected
    assert hits() > before


def test_abort_right_after_a_load_from_the_cpu_tier(swap, probe_tokens):
    engine = swap
    expected = run(engine, {"first": (LONG[0], greedy(4))})["first"]
    engine.engine_core.reset_prefix_cache()  # the device forgets the prompt: the cpu tier has it
    engine.add_request("again", LONG[0], greedy(4))
    engine.step()
    assert engine.engine_core.scheduler.stats()["kv_offload_hit_tokens"] > 0
    engine.abort_request(["again"])
    assert_clean(engine, probe_tokens)
    assert run(engine, {"third": (LONG[0], greedy(4))})["third"] == expected


def test_abort_after_the_disk_tier_promoted_its_blocks(model_path, probe_tokens, tmp_path):
    tiers = dict(kv_offload="cpu,disk", kv_offload_size="16KiB,4MiB", kv_offload_dir=str(tmp_path), enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    first = make_engine(model_path, **tiers)
    expected = run(first, {"first": (prompt, greedy(4))})["first"]
    first.engine_core.shutdown()  # its blocks are written to disk
    engine = make_engine(model_path, **tiers)
    engine.add_request("restarted", prompt, greedy(4))
    engine.step()  # the lookup finds the blocks on disk: they are read back while the request waits
    connector = engine.engine_core.scheduler.kv_connector
    assert list(connector.waiting_remote) == ["restarted"] and connector.connector.loaded == {"restarted"}
    engine.abort_request(["restarted"])  # before it is looked up again
    assert_clean(engine, probe_tokens)
    assert run(engine, {"again": (prompt, greedy(4))})["again"] == expected
    assert engine.engine_core.scheduler.stats()["kv_offload_hits_disk"] > 0


def test_abort_while_its_grammar_compiles(constrained, probe_tokens):
    engine = constrained
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=SLOW_REGEX))
    engine.add_request("constrained", {"prompt_token_ids": [5, 6]}, params)
    scheduler = engine.engine_core.scheduler
    structured = scheduler.structured_output
    assert wait_for(lambda: engine.step() == [] and structured._sandbox is not None and structured._sandbox._busy, 30)
    # it waits in the scheduler (not in its waiting queue) and /metrics counts it as waiting, as vLLM does
    assert scheduler.stats()["num_waiting"] == 1 and [r.request_id for r in scheduler.waiting_for_grammar] == ["constrained"]
    engine.abort_request(["constrained"])
    assert scheduler.stats()["num_waiting"] == 0
    assert wait_for(lambda: not structured._handles, 10)  # the compile was killed, its thread is free
    assert_clean(engine, probe_tokens)


def test_abort_with_n_choices_after_one_finished(plain, probe_tokens):
    engine = plain
    sampled = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
    choices = run(engine, {"free": ({"prompt_token_ids": [9, 8, 7]}, sampled)})["free"]
    # a stop token that ends choice 0 at its third token while the others go on
    stop = choices[0][2]
    assert all(stop not in tokens[:6] for tokens in choices[1:]), choices
    engine.add_request("n3", {"prompt_token_ids": [9, 8, 7]}, SamplingParams(
        temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    for _ in range(20):
        engine.step()
        parent = engine.output_processor.parent_requests["n3"]
        if parent._unfinished_indices == {1, 2}:
            break
    assert parent._unfinished_indices == {1, 2} and len(engine.engine_core.scheduler.running) == 2
    engine.abort_request(["n3"])
    assert_clean(engine, probe_tokens)


def test_abort_with_speculative_decoding(model_path, plain, probe_tokens):
    engine = make_engine(model_path, speculative_config=NGRAM)
    repeating = {"prompt_token_ids": [5, 6, 7] * 4}
    expected = run(plain, {"plain": (repeating, greedy(20))})["plain"]
    engine.add_request("kept", repeating, greedy(20))
    engine.add_request("aborted", repeating, greedy(20))
    scheduler = engine.engine_core.scheduler
    for _ in range(20):  # until drafts are verified (the outputs repeat themselves after a few tokens)
        assert not any(o.finished for o in engine.step())
        if scheduler.stats().get("spec_decode_num_draft_tokens") and scheduler.running[1].spec_token_ids:
            break
    assert scheduler.running[1].request_id == "aborted" and scheduler.running[1].spec_token_ids
    engine.abort_request(["aborted"])
    assert run(engine, {}) == {"kept": expected}
    assert_clean(engine, probe_tokens)


def test_abort_with_its_last_token_in_the_step_in_flight(model_path, probe_tokens):
    engine = make_engine(model_path, async_scheduling=True)
    engine.add_request("last", PROBE, greedy(3))
    request = engine.engine_core.scheduler.requests["last"]
    for _ in range(5):
        engine.step()
        if request.num_output_tokens + request.num_output_placeholders >= 3:
            break
    assert engine.engine_core.in_flight is not None and request.num_output_placeholders
    engine.abort_request(["last"])
    assert_clean(engine, probe_tokens)


def test_abort_after_it_finished_in_the_same_step(plain, probe_tokens):
    """The client's abort crosses the output that finished the request by max_tokens."""
    engine = plain
    engine.add_request("crossed", PROBE, greedy(2))
    assert [o.finished for o in engine.step() + engine.step()] == [False, True]
    engine.abort_request(["crossed"])
    assert_clean(engine, probe_tokens)


def test_stop_string_while_the_engine_still_runs_it(plain, probe_tokens):
    engine = plain
    engine.add_request("full", PROBE, greedy(8))
    text = next(o for _ in range(20) for o in engine.step() if o.finished).outputs[0].text
    stop = text[len(text) // 2 :][:3]
    outputs = run(engine, {"stopped": (PROBE, greedy(8, stop=[stop]))})
    assert len(outputs["stopped"][0]) < 8
    assert_clean(engine, probe_tokens)


def test_a_failed_request_does_not_drop_the_last_token_of_another(constrained, probe_tokens):
    """A grammar that does not compile fails its request in the step that brings another request's last
    token: that output must still arrive (before, it was dropped with the step: the request never finished)."""
    engine = constrained
    expected = run(engine, {"reference": (PROBE, greedy(6))})["reference"]
    engine.add_request("other", PROBE, greedy(6))
    for _ in range(5):
        engine.step()
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a{2,1}"))
    engine.add_request("bad", {"prompt_token_ids": [5, 6]}, bad)
    future = engine.engine_core.scheduler.waiting_for_grammar[0].grammar.future
    deadline = time.monotonic() + 30
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ValueError, match="request bad: invalid regex"):
        engine.step()
    assert engine.has_unfinished_requests()
    outputs = engine.step()
    assert [(o.request_id, o.finished, [list(c.token_ids) for c in o.outputs]) for o in outputs] == [
        ("other", True, expected)]
    assert_clean(engine, probe_tokens)


def add_failing(engine: LLMEngine, request_ids: list[str]) -> None:
    """Requests whose grammars do not compile, added and their compiles waited for."""
    for request_id, regex in zip(request_ids, ["a{2,1}", "[z-a]"]):
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=regex))
        engine.add_request(request_id, {"prompt_token_ids": [5, 6]}, bad)
    futures = [r.grammar.future for r in engine.engine_core.scheduler.waiting_for_grammar]
    assert wait_for(lambda: all(f.done() for f in futures), 30)


def test_failures_of_one_step_are_raised_one_per_call_until_aborted(constrained, probe_tokens):
    engine = constrained
    add_failing(engine, ["bad1", "bad2"])
    for request_id in ("bad1", "bad2"):
        with pytest.raises(ValueError, match=f"request {request_id}: invalid regex"):
            engine.step()
    assert_clean(engine, probe_tokens)
    # as LLM.generate does when one raises: the rest of its requests are aborted, and nothing of them stays
    add_failing(engine, ["bad3", "bad4"])
    engine.add_request("other", PROBE, greedy(4))
    with pytest.raises(ValueError, match="request bad3"):
        engine.step()
    engine.abort_request(["bad4", "other"])
    assert not engine.has_unfinished_requests()
    assert_clean(engine, probe_tokens)
