"""Streams in fewer chunks with the same text: --stream-interval, and merging the outputs a slow reader left queued."""

from __future__ import annotations

import pytest

from runtime.engine.coalesce import merge_outputs
from runtime.engine.output_processor import OutputProcessor
from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.testing.models import smollm2_tokenizer

TEXT = "Hello world, how are you today? Fine, thanks, and you?"


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def stream(tokenizer, interval: int, **params) -> tuple[list, list[int]]:
    """The RequestOutputs of one DELTA request fed TEXT's tokens one step at a time."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer, stream_interval=interval)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, max_tokens=len(ids), **params)
    processor.add_request(EngineCoreRequest("r", [1, 2], params), "prompt")
    outputs = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        logprobs = LogprobsLists([[token_id]], [[-0.5]], [1]) if params.logprobs is not None else None
        step = EngineCoreOutput("r", [token_id], new_logprobs=logprobs, finish_reason=finish)
        outputs += processor.process_outputs([step]).request_outputs
    return outputs, ids


def joined(outputs) -> tuple[str, list[int]]:
    return "".join(o.outputs[0].text for o in outputs), [t for o in outputs for t in o.outputs[0].token_ids]


@pytest.mark.parametrize("interval", [2, 3, 5])
def test_stream_interval_same_text_fewer_chunks(tokenizer, interval):
    every, ids = stream(tokenizer, 1)
    coalesced, _ = stream(tokenizer, interval)
    assert len(every) == len(ids)
    assert joined(coalesced) == joined(every) == (tokenizer.decode(ids), ids)
    sizes = [len(o.outputs[0].token_ids) for o in coalesced]
    assert sizes[0] == 1 and all(size == interval for size in sizes[1:-1]) and 1 <= sizes[-1] <= interval
    assert coalesced[-1].finished and coalesced[-1].outputs[0].finish_reason == "length"


def test_merging_queued_deltas_keeps_text_ids_and_logprobs(tokenizer):
    every, ids = stream(tokenizer, 1, logprobs=0)
    merged = every[0]
    for newer in every[1:]:
        merged = merge_outputs(merged, newer, RequestOutputKind.DELTA)
    completion = merged.outputs[0]
    assert (completion.text, completion.token_ids) == joined(every)
    assert [next(iter(row)) for row in completion.logprobs] == ids
    assert merged.finished and completion.finish_reason == "length"


def test_merging_cumulative_outputs_takes_the_newest(tokenizer):
    every, _ = stream(tokenizer, 1)
    assert merge_outputs(every[0], every[1], RequestOutputKind.CUMULATIVE) is every[1]
