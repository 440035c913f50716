"""A quantized Hugging Face draft (config.json with a quantization_config) loads through its own
quant method, built from its checkpoint as the target's is from the target's.

The draft is the target itself written in vLLM's FP8 layout (static activation scales) by the
quant tests' checkpoint writer, on the CPU reference path. With the float target, greedy tokens
equal transformers' and most drafts are accepted; with the same FP8 checkpoint as
target, the draft is the target's exact copy, so every draft is accepted.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal, reference_outputs

from plugins.quant.quant_checkpoints import write_fp8_checkpoint
from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
CHUNKED_PREFIX = dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float target, its FP8 copy, prompts, transformers' greedy tokens of the float target)."""
    root = tmp_path_factory.mktemp("quant_draft")
    target = build_untokenized_model("llama", root / "target")
    fp8 = write_fp8_checkpoint(target, str(root / "target_fp8"), "static")
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    expected = [tokens for tokens, _ in reference_outputs(target, prompts, NUM_NEW_TOKENS)]
    return target, fp8, prompts, expected


def draft_config(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def test_fp8_draft_of_a_float_target_gives_its_greedy_tokens(checkpoints):
    target, fp8, prompts, expected = checkpoints
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(fp8), **CHUNKED_PREFIX)
    assert llm.llm_engine.config.model_config.quantization is None  # the draft's quantization is its own
    for _ in range(2):
        check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)], "fp8 draft")
    drafted, accepted = spec_counts(llm)
    # FP8 rounding flips some argmaxes of the tiny random model's flat logits (37 of 58 accepted
    # when written); a draft of other weights is accepted about 1 time in 512.
    assert drafted > 0 and accepted >= drafted // 3, (drafted, accepted)
    del llm
    gc.collect()


def test_fp8_draft_of_the_same_fp8_target_is_always_accepted(checkpoints):
    _, fp8, prompts, _ = checkpoints
    llm = LLM(fp8, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config(fp8), **CHUNKED_PREFIX)
    assert llm.llm_engine.config.model_config.quantization == "fp8"
    generate(llm, prompts, GREEDY)
    drafted, accepted = spec_counts(llm)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    del llm
    gc.collect()


def test_quantized_draft_that_cannot_be_split_is_refused_at_tensor_parallel(checkpoints, monkeypatch):
    """A draft whose quant method does not split its layers over ranks (GGUF's blocks; here fp8
    made to say so) is refused at tensor_parallel_size 2, naming the method."""
    import runtime.quantization
    from runtime_spec_decode.draft_model import DraftModelProposer

    fp8 = checkpoints[1]
    monkeypatch.setattr(runtime.quantization, "supports_tensor_parallel", lambda name: name != "fp8")
    with pytest.raises(ValueError, match=r"draft model .* is quantized \('fp8'\) and tensor_parallel_size is 2"):
        DraftModelProposer(fp8, SimpleNamespace(vocab_size=UNTOKENIZED_VOCAB_SIZE), tensor_parallel_size=2)
