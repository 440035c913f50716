"""The per-step fast paths seen from the front end.

``RequestState.update_silently`` takes in FINAL_ONLY outputs without text; the
reference is the same OutputProcessor with that fast path switched off, and the
final output of the same request run as CUMULATIVE. End to end, a tiny model
generates the same tokens with and without the scheduler's decode fast path, under
prefix caching, chunked prefill and forced preemption.
"""

from __future__ import annotations

import random

import pytest

from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, NewTokens
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.parent_request import ParentRequest, fan_out
from runtime.engine.request_state import RequestState
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.testing.models import smollm2_tokenizer

FINAL, CUMULATIVE = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


def make_processor(kind: RequestOutputKind, fast: bool, n: int = 1, **params) -> tuple[OutputProcessor, list[str]]:
    processor = OutputProcessor(tokenizer=None)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(n=n, output_kind=kind, detokenize=False, **params))
    children = fan_out(request)
    parent = ParentRequest(request) if len(children) > 1 else None
    for index, child in enumerate(children):
        [state] = processor.new_states([child], None, parent, index)
        if not fast:
            state.is_ids_only_final = False  # before it is tracked: the processor indexes such states
        processor.add_states([state])
    return processor, [child.request_id for child in children]


def engine_outputs(request_ids: list[str], seed: int, num_steps: int = 6, logprobs: bool = False):
    """Per step, one EngineCoreOutput per request; every request finishes in the last step."""
    rng = random.Random(seed)
    steps = []
    for step in range(num_steps):
        last = step == num_steps - 1
        outputs = []
        for req_id in request_ids:
            token = rng.randrange(5, 100)
            lp = LogprobsLists([[token, 7]], [[-0.5, -0.25]], [2]) if logprobs else None
            finish = (FinishReason.STOP if req_id.startswith("0") else FinishReason.LENGTH) if last else None
            outputs.append(
                EngineCoreOutput(
                    req_id, [token], new_logprobs=lp, finish_reason=finish,
                    stop_reason=token if finish == FinishReason.STOP else None, num_cached_tokens=2 if step == 0 else 0,
                )
            )
        steps.append(outputs)
    return steps


def run(processor: OutputProcessor, steps) -> list[list]:
    return [processor.process_outputs(outputs).request_outputs for outputs in steps]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("logprobs", [False, True])
def test_final_only_without_text_matches_the_general_path(n, logprobs):
    params = dict(logprobs=1) if logprobs else {}
    fast, ids = make_processor(FINAL, fast=True, n=n, **params)
    general, _ = make_processor(FINAL, fast=False, n=n, **params)
    cumulative, _ = make_processor(CUMULATIVE, fast=True, n=n, **params)
    steps = engine_outputs(ids, seed=n, logprobs=logprobs)
    fast_out, general_out, cumulative_out = run(fast, steps), run(general, steps), run(cumulative, steps)
    assert fast_out == general_out
    assert all(not out for out in fast_out[:-1])  # nothing before the end
    [final] = fast_out[-1]
    assert final == cumulative_out[-1][0]
    assert final.finished and final.num_cached_tokens == 2
    for completion, child_id in zip(final.outputs, ids):
        expected = [o.new_token_ids[0] for step in steps for o in step if o.request_id == child_id]
        assert completion.token_ids == expected
        assert (completion.logprobs is not None) == logprobs
    assert not fast.has_unfinished_requests()


def test_fast_path_runs_for_unfinished_final_only_outputs_only(monkeypatch):
    calls = []
    original = RequestState.update
    monkeypatch.setattr(RequestState, "update", lambda self, output: calls.append(output) or original(self, output))
    for kind, expected_calls in ((FINAL, 1), (CUMULATIVE, 6)):
        calls.clear()
        processor, ids = make_processor(kind, fast=True)
        run(processor, engine_outputs(ids, seed=0))
        assert len(calls) == expected_calls, kind


def test_prompt_logprobs_take_the_general_path():
    fast, ids = make_processor(FINAL, fast=True, prompt_logprobs=1)
    general, _ = make_processor(FINAL, fast=False, prompt_logprobs=1)
    steps = engine_outputs(ids, seed=4)
    prompt_lp = LogprobsLists([[2, 9], [3, 9]], [[-1.0, -0.5], [-2.0, -0.1]], [3, 4])
    steps[0][0] = EngineCoreOutput("r", steps[0][0].new_token_ids, new_prompt_logprobs=prompt_lp)
    fast_out, general_out = run(fast, steps), run(general, steps)
    assert fast_out == general_out
    [final] = fast_out[-1]
    assert final.prompt_logprobs[0] is None and sorted(final.prompt_logprobs[1]) == [2, 9]


def test_aborted_request_ignores_later_outputs():
    processor, ids = make_processor(FINAL, fast=True)
    steps = engine_outputs(ids, seed=1)
    run(processor, steps[:2])
    assert processor.abort_requests(["r"]) == ["r"]
    assert run(processor, steps[2:]) == [[]] * 4 and not processor.has_unfinished_requests()


def as_columns(outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], NewTokens | None]:
    """A step as the scheduler sends it: plain one-token outputs (not finished, no logprobs, not a
    first token, which carries num_cached_tokens) as columns, the rest as records."""
    records = [o for o in outputs if o.finished or o.new_logprobs is not None or o.num_cached_tokens or len(o.new_token_ids) != 1]
    plain = [o for o in outputs if o not in records]
    return records, NewTokens([o.request_id for o in plain], [o.new_token_ids[0] for o in plain]) if plain else None


@pytest.mark.parametrize("kind", [FINAL, CUMULATIVE, RequestOutputKind.DELTA])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("with_text", [False, True])
def test_columns_give_the_outputs_records_give(kind, n, with_text):
    """The step's plain tokens as columns (``EngineCoreOutputs.new_tokens``) or as records: the same
    RequestOutputs, with and without text (batched detokenizing takes the columns too)."""
    tokenizer = smollm2_tokenizer() if with_text else None
    processors = []
    for _ in range(2):
        processor = OutputProcessor(tokenizer=tokenizer)
        request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(n=n, output_kind=kind, detokenize=with_text))
        children = fan_out(request)
        parent = ParentRequest(request) if len(children) > 1 else None
        for index, child in enumerate(children):
            processor.add_request(child, None, parent, index)
        processors.append(processor)
    steps = engine_outputs([child.request_id for child in children], seed=7, num_steps=8)
    by_records = [processors[0].process_outputs(step).request_outputs for step in steps]
    by_columns = [processors[1].process_outputs(*as_columns(step)).request_outputs for step in steps]
    assert any(as_columns(step)[1] is not None for step in steps)
    assert by_columns == by_records
    assert by_records[-1] and by_records[-1][0].finished


# ----------------------------------------------------------------------------- end to end


def tiny_llama(path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ).save_pretrained(path)
    return str(path)


def generate(model: str, kind: RequestOutputKind, fast_decode: bool, prompts: list[list[int]]):
    from runtime.engine_args import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model, load_format="dummy", dtype="float32", skip_tokenizer_init=True, block_size=4,
        enable_prefix_caching=True, num_gpu_blocks_override=24, max_model_len=64, max_num_batched_tokens=16,
    )
    engine = LLMEngine.from_engine_args(args)
    scheduler = engine.engine_core.scheduler
    if not fast_decode:
        scheduler.kv_cache_manager.no_op_decode_offsets = range(0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False, output_kind=kind)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    stats = (scheduler.num_preemptions, scheduler.kv_cache_manager.stats.hits)
    return [finished[str(i)] for i in range(len(prompts))], stats


def test_engine_tokens_identical_with_and_without_fast_paths(tmp_path):
    model = tiny_llama(tmp_path)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 256) for _ in range(9)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    reference, (num_preemptions, hits) = generate(model, CUMULATIVE, False, prompts)
    assert num_preemptions > 0 and hits > 0  # the settings do force preemption and share blocks
    assert all(len(tokens) == 20 for tokens in reference)
    assert generate(model, FINAL, True, prompts) == (reference, (num_preemptions, hits))
    assert generate(model, CUMULATIVE, True, prompts)[0] == reference
