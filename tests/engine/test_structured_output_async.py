"""Structured output with async scheduling: constrained requests are scheduled ahead like free ones.

The engine queues step N+1 while step N runs; the model runner launches N+1's forward pass, and
only then is N+1's bitmask filled, after the engine has collected step N (the grammars advance on
its tokens). Outputs must be exactly those of the synchronous engine: requests that step N ends
(grammar complete, stop token, max_tokens, abort) while N+1 is queued emit nothing more and
their rows in N+1's bitmask are filled without touching the ended grammar; every constrained
request that samples gets a row and no other does, through chunked prefills and cached prefixes;
and a worker in another process (the bitmask pickled filled) gets the same tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import runtime
from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_args import EngineArgs
from runtime.scheduler.request import Request, RequestStatus
from runtime.scheduler.structured_output import StructuredOutputManager
from runtime.testing.models import build_tiny_model
from support.token_trie_grammar import TrieBackend, TrieGrammar, choice_spec

BACKEND_NAME = "strict_token_trie"
EOS = 2  # SmolLM2's tokenizer (the tiny test models use it)
SEQUENCES = [[100, 200, 300, 301, 302], [100, 200, 400], [100, 200, 400, 500, 600, 700], [700, 800, 900, 1000, 1100, 1200]]
LONG = [[700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600]]
PROMPTS = [[101, 2045, 7, 880, 42], [9001, 15, 15, 300], [77, 78, 79, 80, 81, 82, 83], [5000, 12], [31, 4, 15, 9, 26, 5, 35, 8, 97]]
FORKS: list["StrictGrammar"] = []  # every request's grammar, in the order they were forked


class StrictGrammar(TrieGrammar):
    """Fails where a real backend may (filling a grammar that has ended); counts its fills."""

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.is_terminated():
            raise AssertionError(f"a bitmask row was filled from an ended grammar (state {self.state})")
        super().fill_bitmask(bitmask, row)

    def fork(self) -> "StrictGrammar":
        grammar = StrictGrammar(self.sequences, self.eos)
        FORKS.append(grammar)
        return grammar


class StrictBackend(TrieBackend):
    def compile(self, kind, spec: str) -> StrictGrammar:
        grammar = super().compile(kind, spec)
        return StrictGrammar(grammar.sequences, grammar.eos)


class StrictBackendPlugin:
    @staticmethod
    @runtime.hookimpl
    def register_guided_backends(register):
        register(BACKEND_NAME, StrictBackend)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("structured_async_llama"))


@pytest.fixture
def strict_backend(plugin_manager):
    plugin_manager.register(StrictBackendPlugin, "strict_token_trie_test")
    FORKS.clear()
    return plugin_manager


def constrained(sequences, **extra) -> SamplingParams:
    extra = dict(temperature=0.0, max_tokens=12) | extra
    return SamplingParams(structured_outputs=StructuredOutputsParams(choice=choice_spec(sequences)), **extra)


def make_llm(model_path, async_scheduling: bool, **kwargs) -> LLM:
    kwargs = dict(dtype="float32", max_model_len=128, block_size=4, guided_decoding_backend=BACKEND_NAME) | kwargs
    return LLM(model_path, async_scheduling=async_scheduling, **kwargs)


def completions(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


# Each but max_tokens ends while its next step is already queued (no step is queued past max_tokens).
ENDINGS = [
    constrained([[100, 200, 300]]),  # the grammar completes on a text token
    constrained([[100, 200, 300, 301, 302]], stop_token_ids=[300]),  # a stop token, inside the grammar
    constrained(LONG, max_tokens=3),  # max_tokens
    constrained([[100, 200], [100, 200, 400, 500]]),  # EOS or more: the model chooses
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # a free request beside them
]


def test_requests_ending_with_a_step_in_flight_emit_nothing_more(strict_backend, model_path):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for async_scheduling in (False, True):
        FORKS.clear()
        llm = make_llm(model_path, async_scheduling)
        outputs = llm.generate(prompts, ENDINGS, use_tqdm=False)
        # One fill per token sampled and kept: the rows of ended requests in a queued step are not
        # filled from their grammars (StrictGrammar would raise), and no token of theirs is kept.
        constrained_tokens = sum(len(o.outputs[0].token_ids) for o in outputs[:4])
        assert sum(g.num_bitmask_fills for g in FORKS) == constrained_tokens
        runs[async_scheduling] = completions(outputs), llm.llm_engine.engine_core.num_steps_ahead
    (sync, _), (overlapped, steps_ahead) = runs[False], runs[True]
    assert overlapped == sync
    assert sync[0] == [([100, 200, 300], "stop", None)]
    assert sync[1] == [([100, 200, 300], "stop", 300)]
    assert sync[2] == [([700, 800, 900], "length", None)]
    assert sync[3][0][0] in ([100, 200, EOS], [100, 200, 400, 500])
    assert steps_ahead > 0


def test_constrained_requests_alone_are_scheduled_ahead(strict_backend, model_path):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [constrained(SEQUENCES), constrained(LONG, max_tokens=8), constrained(SEQUENCES, n=3)]
    sync = make_llm(model_path, False).generate(prompts[:3], params, use_tqdm=False)
    llm = make_llm(model_path, True)
    core = llm.llm_engine.engine_core
    overlapped = llm.generate(prompts[:3], params, use_tqdm=False)
    assert completions(overlapped) == completions(sync)
    assert core.num_steps_ahead >= 7  # LONG's 8 tokens: every decode step but the first queued ahead
    for output in overlapped:
        for completion in output.outputs:
            tokens = completion.token_ids
            assert (tokens[:-1] if tokens[-1] == EOS else tokens) in SEQUENCES + [LONG[0][:8]]
    assert core.scheduler.can_schedule_ahead() and not core.scheduler.requests


def test_constrained_requests_that_read_host_outputs_still_drain(strict_backend, model_path):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    params = [constrained(SEQUENCES, repetition_penalty=1.3), constrained(LONG, min_tokens=4, max_tokens=6)]
    sync = make_llm(model_path, False).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model_path, True)
    assert completions(llm.generate(prompts, params, use_tqdm=False)) == completions(sync)
    assert llm.llm_engine.engine_core.num_steps_ahead == 0  # penalties and min_tokens read output ids on the host


def test_random_sampling_with_n_stays_inside_the_grammar(strict_backend, model_path):
    llm = make_llm(model_path, True)
    params = constrained(SEQUENCES, temperature=1.5, n=6, logprobs=2)
    seen = set()
    for output in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False):
        assert len(output.outputs) == 6
        for completion in output.outputs:
            grammar = TrieGrammar([tuple(s) for s in SEQUENCES], EOS)
            for token, position in zip(completion.token_ids, completion.logprobs):
                allowed = grammar._allowed(grammar.state)
                assert token in allowed and all(t in allowed or lp.logprob == float("-inf") for t, lp in position.items())
                assert grammar.accept_tokens([token])
            assert grammar.is_terminated() and completion.finish_reason == "stop"
            seen.add(tuple(completion.token_ids))
    assert len(seen) > 1 and llm.llm_engine.engine_core.num_steps_ahead > 0


def record_steps(engine: LLMEngine) -> list[tuple]:
    """Record each launched step (its scheduler output and pending result); at every bitmask fill,
    check that every step launched before this one has been collected (update_from_output)."""
    core = engine.engine_core
    steps, collected = [], []
    launch, update = core.executor.execute_model_async, core.scheduler.update_from_output
    fill_rows = core.structured_output.fill_rows

    def launching(so):
        steps.append([so, None])
        steps[-1][1] = launch(so)
        return steps[-1][1]

    def updating(so, runner_output):
        collected.append(so)
        return update(so, runner_output)

    def filling(requests):
        assert collected == [so for so, _ in steps[:-1]], "a bitmask was filled before the previous step was collected"
        return fill_rows(requests)

    core.executor.execute_model_async = launching
    core.executor.execute_model = lambda so: launching(so).result()  # the synchronous engine's call
    core.scheduler.update_from_output = updating
    core.structured_output.fill_rows = filling
    return steps


def run_engine(model_path, async_scheduling: bool, abort_at: dict[int, str] | None = None, **kwargs):
    """Requests '0'..'4' (odd ones free) through LLMEngine.step, twice (the second run reads cached
    prefixes); aborts ``abort_at[step]`` after that step. Returns (finished tokens by id, steps, engine)."""
    args = dict(model=model_path, dtype="float32", max_model_len=128, block_size=4, guided_decoding_backend=BACKEND_NAME)
    engine = LLMEngine.from_engine_args(EngineArgs(async_scheduling=async_scheduling, **args | kwargs))
    steps = record_steps(engine)
    done: dict[str, list[int]] = {}
    for run in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) if i % 2 else constrained(LONG)
            params.detokenize = False
            engine.add_request(f"{run}-{i}", {"prompt_token_ids": prompt}, params)
        num_steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            num_steps += 1
            if abort_at and num_steps in abort_at:
                engine.abort_request([f"{run}-{abort_at[num_steps]}"])
    return done, steps, engine


CHUNKED_PREFIX = dict(max_num_batched_tokens=8, enable_prefix_caching=True)


def test_every_sampling_constrained_request_gets_a_row_and_no_other(strict_backend, model_path):
    sync, _, _ = run_engine(model_path, False, **CHUNKED_PREFIX)
    done, steps, engine = run_engine(model_path, True, **CHUNKED_PREFIX)
    assert done == sync and len(done) == 2 * len(PROMPTS)
    assert all(tokens == LONG[0] for rid, (tokens, _) in done.items() if int(rid[-1]) % 2 == 0)
    core = engine.engine_core
    assert core.num_steps_ahead > 0 and core.scheduler.kv_cache_manager.stats.hits > 0
    prefills = 0
    for so, pending in steps:
        sampled = set(pending.result().req_ids)
        constrained_ids = {rid for rid in so.num_scheduled_tokens if int(rid[-1]) % 2 == 0}
        assert set(so.structured_output_request_ids) == constrained_ids & sampled
        prefills += bool(constrained_ids - sampled)  # a chunk short of the prompt's end: no row
    assert prefills > 0


def test_abort_of_a_constrained_request_with_a_step_in_flight(strict_backend, model_path):
    sync, _, _ = run_engine(model_path, False, abort_at={4: "2"})
    done, _, engine = run_engine(model_path, True, abort_at={4: "2"})
    assert set(done) == {f"{run}-{i}" for run in range(2) for i in (0, 1, 3, 4)}
    assert done == {k: v for k, v in sync.items() if not k.endswith("-2")}
    assert engine.engine_core.num_steps_ahead > 0 and not engine.engine_core.scheduler.requests


def test_a_worker_process_gets_the_same_tokens(strict_backend, model_path):
    """The multiproc executor pickles the step, bitmask filled (the step in flight collected first)."""
    sync, _, _ = run_engine(model_path, False)
    done, steps, engine = run_engine(model_path, True, executor="multiproc")
    try:
        assert done == sync and engine.engine_core.num_steps_ahead > 0
        assert any(so.structured_output_request_ids for so, _ in steps)
    finally:
        engine.engine_core.shutdown()


def test_rows_of_requests_ended_since_scheduling_allow_every_token():
    grammars = [StrictGrammar([(5, 6)], EOS), StrictGrammar([(7,)], EOS)]
    manager = StructuredOutputManager(lambda: None, vocab_size=64, compile_timeout=1.0)
    requests = []
    for i, grammar in enumerate(grammars):
        request = Request(str(i), [1], SamplingParams())
        request.grammar = SimpleNamespace(grammar=grammar, gate=None, constrains=True)  # a compiled RequestGrammar
        request.status = RequestStatus.RUNNING
        requests.append(request)
    rows, bitmask = manager.grammar_bitmask(requests)
    assert grammars[1].accept_tokens([7])  # the step in flight completes request 1's grammar ...
    requests[1].status = RequestStatus.FINISHED_STOPPED  # ... which ends it
    filled = bitmask.tensor()
    allowed = [{t for t in range(64) if filled[row, t // 32] >> (t % 32) & 1} for row in range(2)]
    assert rows == {"0": 0, "1": 1} and allowed == [{5}, set(range(64))]
    assert grammars[0].num_bitmask_fills == 1 and grammars[1].num_bitmask_fills == 0


def test_outlines_json_outputs_match_the_synchronous_run(plugin_manager, model_path):
    """The real guided backend (its batched fill, with rows of ended requests left out)."""
    pytest.importorskip("runtime_outlines")
    import json

    from runtime.bench.structured import SCHEMAS

    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)] + [i + 3]} for i in range(2 * len(SCHEMAS))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, detokenize=False,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
              for i in range(len(prompts))]
    runs = []
    for async_scheduling in (False, True):
        llm = make_llm(model_path, async_scheduling, guided_decoding_backend="outlines")
        runs.append(completions(llm.generate(prompts, params, use_tqdm=False)))
    assert runs[1] == runs[0] and llm.llm_engine.engine_core.num_steps_ahead > 0
    tokenizer = llm.get_tokenizer()
    ended = [tokens for (tokens, reason, _), in runs[1] if reason == "stop"]
    assert ended and all(isinstance(json.loads(tokenizer.decode(t, skip_special_tokens=True)), dict) for t in ended)
