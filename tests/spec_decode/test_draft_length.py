"""A draft model that holds fewer positions than the target's max_model_len: with no --max-model-len the
engine lowers max_model_len to the draft's length (as vLLM does; it used to refuse to start); a larger
--max-model-len given explicitly is refused at start, naming both lengths and the flag to lower (it used
to start, then run the draft past its last position on long requests: garbage drafts on the CPU, an
out-of-range read of its rotary table on GPUs)."""

from __future__ import annotations

import gc
import logging

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts
from spec_decode.heads import edit_config

DRAFT_POSITIONS = 48


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """(target path with 512 positions, a draft of other weights with DRAFT_POSITIONS)."""
    root = tmp_path_factory.mktemp("draft_length")
    target = build_untokenized_model("llama", root / "target")
    draft = build_untokenized_model("llama", root / "draft", seed=1)
    edit_config(draft, lambda config: config.update(max_position_embeddings=DRAFT_POSITIONS))
    return target, draft


def spec(draft) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


@pytest.mark.parametrize("max_model_len", [512, DRAFT_POSITIONS + 1])  # 512: the target's own, given explicitly
def test_explicit_max_model_len_past_the_draft_is_refused_at_start(short_draft, max_model_len):
    target, draft = short_draft
    with pytest.raises(ValueError, match=rf"draft model '{draft}' supports at most {DRAFT_POSITIONS} positions "
                                         rf"\(max_position_embeddings\), but the target's max_model_len is {max_model_len}: "
                                         rf"lower max_model_len \(--max-model-len\) to {DRAFT_POSITIONS} or less"):
        LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=spec(draft),
            max_model_len=max_model_len)


def test_default_max_model_len_is_lowered_to_the_draft(short_draft, caplog):
    """No --max-model-len: the engine runs with the draft's length (logged naming both), the tokens unchanged."""
    target, draft = short_draft
    prompts = [p[:8] for p in repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    baseline = LLM(target, dtype="float32", skip_tokenizer_init=True)
    assert baseline.llm_engine.config.model_config.max_model_len == 512
    expected = [o.outputs[0].token_ids for o in generate(baseline, prompts, params)]
    del baseline
    gc.collect()
    with caplog.at_level(logging.INFO, logger="runtime.speculative_config"):
        llm = LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=spec(draft))
    config = llm.llm_engine.config
    assert config.model_config.max_model_len == config.scheduler_config.max_model_len == DRAFT_POSITIONS
    assert f"max_model_len is {DRAFT_POSITIONS}, not the target model's 512" in caplog.text
    assert repr(draft) in caplog.text
    check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, params)], "capped")
    assert spec_counts(llm)[0] > 0, "nothing was drafted"
    with pytest.raises(ValueError, match=rf"max_model_len is {DRAFT_POSITIONS}"):  # the front end holds the cap too
        generate(llm, [[3] * DRAFT_POSITIONS], params)


def test_draft_runs_when_max_model_len_fits_it(short_draft):
    target, draft = short_draft
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=DRAFT_POSITIONS)
    baseline = LLM(target, **kwargs)
    expected = [o.outputs[0].token_ids for o in generate(baseline, prompts, params)]
    del baseline
    gc.collect()
    llm = LLM(target, speculative_config=spec(draft), **kwargs)
    check_outputs_equal(expected, [o.outputs[0].token_ids for o in generate(llm, prompts, params)], "short draft")
    assert spec_counts(llm)[0] > 0, "nothing was drafted"
