"""The incremental detokenizer decodes a short window per token, also across long runs of
special tokens that skip_special_tokens drops (a model that repeats EOS under ignore_eos)."""

from __future__ import annotations

from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.engine.output_processor import OutputProcessor
from runtime.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from runtime.sampling_params import RequestOutputKind, SamplingParams
from runtime.testing.models import smollm2_tokenizer


def _record_windows(detok: IncrementalDetokenizer) -> list[int]:
    """Wrap ``detok._decode``; return the list that gets the length of every window it decodes."""
    sizes: list[int] = []
    decode = detok._decode

    def recording(ids):
        sizes.append(len(ids))
        return decode(ids)

    detok._decode = recording
    return sizes


def test_skipped_special_tokens_do_not_widen_the_window():
    tokenizer = smollm2_tokenizer()
    eos = tokenizer.eos_token_id
    text_ids = tokenizer.encode("Done. And then more words", add_special_tokens=False)
    ids = text_ids[:2] + [eos] * 300 + text_ids[2:] + [eos] * 300
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt", add_special_tokens=False), SamplingParams())
    sizes = _record_windows(detok)
    for token_id in ids:
        assert detok.update([token_id], False) is None
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == "Done. And then more words"
    assert detok.output_token_ids == ids
    # The window holds the last few text tokens, not the run of EOS tokens.
    assert max(sizes) <= 8, max(sizes)


def test_skipped_special_tokens_in_a_batched_step():
    """The OutputProcessor's one-batch decode of a step (several requests) agrees with the silent skip."""
    tokenizer = smollm2_tokenizer()
    eos = tokenizer.eos_token_id
    text_ids = tokenizer.encode("Hello there, friend", add_special_tokens=False)
    streams = {
        "a": text_ids[:1] + [eos] * 50 + text_ids[1:],
        "b": [eos] * 20 + text_ids,
    }
    processor = OutputProcessor(tokenizer)
    for request_id in streams:
        params = SamplingParams(output_kind=RequestOutputKind.DELTA)
        processor.add_request(EngineCoreRequest(request_id, [1, 2], params), "prompt")
    texts = {request_id: "" for request_id in streams}
    for position in range(max(len(ids) for ids in streams.values())):
        outputs = []
        for request_id, ids in streams.items():
            if position < len(ids):
                finish = FinishReason.LENGTH if position == len(ids) - 1 else None
                outputs.append(EngineCoreOutput(request_id, [ids[position]], finish_reason=finish))
        for request_output in processor.process_outputs(outputs).request_outputs:
            texts[request_output.request_id] += request_output.outputs[0].text
    assert texts == {"a": "Hello there, friend", "b": "Hello there, friend"}
    assert not processor.has_unfinished_requests()
