"""OutputProcessor: EngineCoreOutputs -> RequestOutputs, checked against tokenizer.decode."""

from __future__ import annotations

import math

import pytest

from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.parent_request import ParentRequest, fan_out
from runtime.outputs import RequestOutput
from runtime.sampling_params import RequestOutputKind, SamplingParams

from runtime.testing.models import smollm2_tokenizer

TEXT = "Hello world, how are you today? Fine, thanks."


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


def make_request(request_id: str, prompt_ids: list[int], **params) -> EngineCoreRequest:
    params = SamplingParams(**params)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params)


def add(processor: OutputProcessor, request: EngineCoreRequest, prompt: str | None = "prompt") -> list[str]:
    """Add a request the way LLMEngine does (fanned out when n > 1); return the engine ids."""
    children = fan_out(request)
    parent = ParentRequest(request) if len(children) > 1 else None
    for index, child in enumerate(children):
        processor.add_request(child, prompt, parent, index)
    return [child.request_id for child in children]


def step(processor, request_id, token_ids, finish=None, stop_reason=None, logprobs=None, prompt_logprobs=None):
    output = EngineCoreOutput(
        request_id, token_ids, new_logprobs=logprobs, new_prompt_logprobs=prompt_logprobs,
        finish_reason=finish, stop_reason=stop_reason,
    )
    return processor.process_outputs([output])


def run_one_by_one(processor, request_id, ids, last_finish=FinishReason.LENGTH) -> list[RequestOutput]:
    outputs = []
    for i, token_id in enumerate(ids):
        finish = last_finish if i == len(ids) - 1 else None
        outputs += step(processor, request_id, [token_id], finish).request_outputs
    return outputs


def test_cumulative_outputs(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", [1, 2, 3]))
    outputs = run_one_by_one(processor, "r", ids)
    assert len(outputs) == len(ids)
    for n, out in enumerate(outputs, start=1):
        completion = out.outputs[0]
        assert out.request_id == "r" and out.prompt == "prompt" and out.prompt_token_ids == [1, 2, 3]
        assert completion.token_ids == ids[:n]
        assert completion.text == tokenizer.decode(ids[:n])
        assert out.finished == (n == len(ids)) == completion.finished()
        assert completion.cumulative_logprob is None and completion.logprobs is None
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[-1].outputs[0].stop_reason is None
    assert not processor.has_unfinished_requests()


def test_delta_outputs(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", [1], output_kind=RequestOutputKind.DELTA))
    outputs = run_one_by_one(processor, "r", ids)
    assert [o.outputs[0].token_ids for o in outputs] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in outputs) == TEXT
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]


def test_final_only_output(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", [1], output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = run_one_by_one(processor, "r", ids)
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == TEXT and outputs[0].outputs[0].token_ids == ids


def logprob_rows(ids: list[int], num_top: int, seed: int) -> LogprobsLists:
    """Rows of the chosen token then the top tokens (the first row's chosen token is also its top-1)."""
    rows_ids, rows_lp, ranks = [], [], []
    for i, chosen in enumerate(ids):
        if i == 0 and num_top > 0:
            top = [chosen] + [100 + seed + k for k in range(num_top - 1)]
        else:
            top = [200 + k for k in range(num_top)]
        lps = [-0.1 * (i + 1) - 0.01 * seed] + [-0.05 * (k + 1) for k in range(num_top)]
        rows_ids.append([chosen] + top)
        rows_lp.append(lps)
        ranks.append(1 if i == 0 else 7 + i)
    return LogprobsLists(token_ids=rows_ids, logprobs=rows_lp, ranks=ranks)


def test_logprobs_conversion(tokenizer, ids):
    sample = ids[:3]
    lists = logprob_rows(sample, num_top=2, seed=0)
    prompt_ids = ids[3:7]
    prompt_lists = logprob_rows(prompt_ids[1:], num_top=2, seed=1)
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", prompt_ids, logprobs=2, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA))
    head = LogprobsLists(lists.token_ids[:2], lists.logprobs[:2], lists.ranks[:2])
    tail = LogprobsLists(lists.token_ids[2:], lists.logprobs[2:], lists.ranks[2:])
    first = step(processor, "r", sample[:2], logprobs=head, prompt_logprobs=prompt_lists).request_outputs[0]
    second = step(processor, "r", sample[2:], finish=FinishReason.LENGTH, logprobs=tail).request_outputs[0]
    logprobs = first.outputs[0].logprobs + second.outputs[0].logprobs
    assert len(first.outputs[0].logprobs) == 2 and len(second.outputs[0].logprobs) == 1
    for row, entry in enumerate(logprobs):
        # Chosen token first with its vocabulary rank, then the top tokens ranked 1, 2, ...
        expected = {lists.token_ids[row][0]: (lists.logprobs[row][0], lists.ranks[row])}
        for k, (token_id, lp) in enumerate(zip(lists.token_ids[row][1:], lists.logprobs[row][1:]), start=1):
            expected.setdefault(token_id, (lp, k))
        assert list(entry) == list(expected)
        assert {t: v.rank for t, v in entry.items()} == {t: rank for t, (_, rank) in expected.items()}
        assert {t: v.logprob for t, v in entry.items()} == pytest.approx({t: lp for t, (lp, _) in expected.items()})
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in entry.items())
    assert len(logprobs[0]) == 2  # the chosen token was also the top-1: one entry
    assert second.outputs[0].cumulative_logprob == pytest.approx(math.fsum(r[0] for r in lists.logprobs))
    # Prompt logprobs: None for the first prompt token, sent once in DELTA mode.
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt_ids)
    assert [next(iter(d)) for d in first.prompt_logprobs[1:]] == prompt_ids[1:]
    assert second.prompt_logprobs is None


def test_stop_string_finishes_and_asks_for_abort(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", [1], stop=["are you"], logprobs=0))
    hit = next(n for n in range(1, len(ids) + 1) if "are you" in tokenizer.decode(ids[:n]))
    # The whole text in one step (as speculative decoding may send it).
    processed = step(processor, "r", ids, logprobs=logprob_rows(ids, num_top=0, seed=0))
    assert processed.reqs_to_abort == ["r"]
    (out,) = processed.request_outputs
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "stop" and completion.stop_reason == "are you"
    assert completion.text == TEXT[: TEXT.index("are you")]
    assert completion.token_ids == ids[:hit] and len(completion.logprobs) == hit
    assert not processor.has_unfinished_requests()
    # Outputs the engine sends before the abort lands are ignored.
    assert step(processor, "r", [5]).request_outputs == []


def test_engine_finish_reasons(tokenizer, ids):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    processor = OutputProcessor(tokenizer)
    for request_id, finish, stop_reason, last in [
        ("eos", FinishReason.STOP, None, eos),
        ("token", FinishReason.STOP, ids[-1], ids[-1]),
        ("abort", FinishReason.ABORT, None, ids[-1]),
    ]:
        add(processor, make_request(request_id, [1], skip_special_tokens=False))
        step(processor, request_id, ids[:-1])
        processed = step(processor, request_id, [last], finish=finish, stop_reason=stop_reason)
        assert processed.reqs_to_abort == []
        completion = processed.request_outputs[0].outputs[0]
        assert completion.finish_reason == finish.value and completion.stop_reason == stop_reason
        assert completion.token_ids == ids[:-1] + [last]
        # The stop token stays out of the text; an aborted request keeps its last token.
        expected_ids = ids if finish == FinishReason.ABORT else ids[:-1]
        assert completion.text == tokenizer.decode(expected_ids)


def test_fan_out():
    request = make_request("r", [1, 2], n=3, seed=7, temperature=0.8)
    children = fan_out(request)
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 and c.sampling_params.temperature == 0.8 for c in children)
    assert all(c.prompt_token_ids == [1, 2] for c in children)
    assert request.sampling_params.n == 3 and request.sampling_params.seed == 7
    assert [c.sampling_params.seed for c in fan_out(make_request("s", [1], n=2))] == [None, None]
    single = make_request("one", [1])
    assert fan_out(single) == [single] and fan_out(single)[0] is single


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_n2_gathered_under_parent(tokenizer, ids, kind):
    processor = OutputProcessor(tokenizer)
    assert add(processor, make_request("r", [1], n=2, output_kind=kind)) == ["0_r", "1_r"]
    a, b = ids[:4], ids[4:9]
    outputs = []
    for i in range(len(b)):
        step_outputs = []
        if i < len(a):  # child 1 first: the parent's outputs are still ordered by index
            finish = FinishReason.LENGTH if i == len(a) - 1 else None
            step_outputs.append(EngineCoreOutput("1_r", [a[i]], finish_reason=finish))
        finish = FinishReason.LENGTH if i == len(b) - 1 else None
        step_outputs.append(EngineCoreOutput("0_r", [b[i]], finish_reason=finish))
        processed = processor.process_outputs(step_outputs)
        assert len(processed.request_outputs) <= 1
        outputs += processed.request_outputs
    assert all(o.request_id == "r" for o in outputs)
    assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
    final = outputs[-1]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    if kind == RequestOutputKind.DELTA:
        texts = {0: "", 1: ""}
        for out in outputs:
            assert [c.index for c in out.outputs] == sorted(c.index for c in out.outputs)
            for c in out.outputs:
                texts[c.index] += c.text
        assert texts == {0: tokenizer.decode(b), 1: tokenizer.decode(a)}
    else:
        assert [c.index for c in final.outputs] == [0, 1]
        assert [c.text for c in final.outputs] == [tokenizer.decode(b), tokenizer.decode(a)]
        assert [c.token_ids for c in final.outputs] == [b, a]
    assert not processor.has_unfinished_requests()
    assert processor.parent_requests == {}


def test_abort_requests(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("p", [1], n=2))
    add(processor, make_request("s", [1]))
    assert processor.get_num_unfinished_requests() == 3
    step(processor, "0_p", ids[:2])
    assert sorted(processor.abort_requests(["p"])) == ["0_p", "1_p"]
    assert processor.get_num_unfinished_requests() == 1 and processor.has_unfinished_requests()
    assert step(processor, "1_p", ids[:1]).request_outputs == []
    assert processor.abort_requests(["s", "unknown"]) == ["s", "unknown"]
    assert not processor.has_unfinished_requests()
    assert processor.parent_requests == {}


def test_no_tokenizer(ids):
    processor = OutputProcessor(None)
    add(processor, make_request("r", [1], logprobs=1, detokenize=False), prompt=None)
    rows = logprob_rows(ids[:1], num_top=1, seed=0)
    out = step(processor, "r", ids[:1], finish=FinishReason.LENGTH, logprobs=rows).request_outputs[0]
    completion = out.outputs[0]
    assert completion.text == "" and completion.token_ids == ids[:1]
    assert all(v.decoded_token is None for v in completion.logprobs[0].values())
    with pytest.raises(ValueError, match="stop strings"):
        processor.add_request(make_request("x", [1], stop=["a"]), None)


def test_duplicate_request_id_is_rejected(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, make_request("r", [1]))
    with pytest.raises(ValueError, match="already running"):
        add(processor, make_request("r", [1]))
