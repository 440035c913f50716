"""A step's new tokens are detokenized in one batch call: the texts are those of one request at a time."""

from __future__ import annotations

import pytest

from runtime.engine.output_processor import OutputProcessor
from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.testing.models import smollm2_tokenizer

TEXTS = [
    "Hello world, how are you today?",
    "Ünïcödé — 漢字とかな, and emoji 🎉🚀 too.",
    "<|im_start|>assistant\nSure!<|im_end|> Done.",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "1 2 3 4 5 6 7 8 9 10",
]
PARAMS = [  # (skip_special_tokens, spaces_between_special_tokens, stop)
    (True, True, None), (False, False, None), (False, True, None), (True, False, ["how are"]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def run(tokenizer, batched: bool, calls: list | None = None) -> dict[str, tuple[str, list[int], str | None]]:
    """Every (text, params) pair as a streamed request; batched: all of a step's outputs in one call
    (each batch decode call's number of windows noted in ``calls``)."""
    processor = OutputProcessor(tokenizer)
    decode = processor._batch_decode
    processor._batch_decode = lambda seqs, skip: calls.append(len(seqs)) or decode(seqs, skip)
    tokens, texts = {}, {}
    for i, text in enumerate(TEXTS):
        for j, (skip, spaces, stop) in enumerate(PARAMS):
            request_id = f"r{i}-{j}"
            params = SamplingParams(output_kind=RequestOutputKind.DELTA, skip_special_tokens=skip,
                                    spaces_between_special_tokens=spaces, stop=stop)
            processor.add_request(EngineCoreRequest(request_id, tokenizer.encode("Say:"), params), "Say:")
            tokens[request_id] = tokenizer.encode(text, add_special_tokens=False)
            texts[request_id] = ("", [], None)
    for position in range(max(len(t) for t in tokens.values())):
        step = [
            EngineCoreOutput(rid, [ids[position]], finish_reason=FinishReason.LENGTH if position == len(ids) - 1 else None)
            for rid, ids in tokens.items() if position < len(ids) and rid in processor.request_states
        ]
        for chunk in ([step] if batched else [[o] for o in step]):
            for out in processor.process_outputs(chunk).request_outputs:
                text, ids, reason = texts[out.request_id]
                completion = out.outputs[0]
                texts[out.request_id] = (text + completion.text, ids + completion.token_ids, completion.finish_reason or reason)
    return texts


def test_batched_detokenizing_gives_the_texts_of_one_request_at_a_time(tokenizer):
    calls_alone, calls = [], []
    alone, batched = run(tokenizer, False, calls_alone), run(tokenizer, True, calls)
    assert batched == alone
    # the first step: one call per skip_special_tokens value, two windows per request not split at special tokens
    assert calls_alone == [] and calls[:2] == [2 * len(TEXTS) * 2, 2 * len(TEXTS)]
    assert alone["r1-0"][0] == TEXTS[1] and alone["r2-0"][0] == "assistant\nSure! Done."
    assert alone["r0-3"] == ("Hello world, ", alone["r0-3"][1], "stop")
