"""A draft model that holds fewer positions than the target's max_model_len is refused when the engine
starts, naming both lengths and the flag to lower (it used to start, then run the draft past its last
position on long requests: garbage drafts on the CPU, an out-of-range read of its rotary table on GPUs)."""

from __future__ import annotations

import gc
import json
import os

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

DRAFT_POSITIONS = 48


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """(target path with 512 positions, a draft of other weights with DRAFT_POSITIONS)."""
    root = tmp_path_factory.mktemp("draft_length")
    target = build_untokenized_model("llama", root / "target")
    draft = build_untokenized_model("llama", root / "draft", seed=1)
    config_file = os.path.join(draft, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["max_position_embeddings"] = DRAFT_POSITIONS
    with open(config_file, "w") as f:
        json.dump(config, f)
    return target, draft


def spec(draft) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


@pytest.mark.parametrize("max_model_len", [None, DRAFT_POSITIONS + 1])
def test_draft_shorter_than_max_model_len_is_refused_at_start(short_draft, max_model_len):
    target, draft = short_draft
    target_len = max_model_len or 512
    kwargs = {} if max_model_len is None else {"max_model_len": max_model_len}
    with pytest.raises(ValueError, match=rf"draft model '{draft}' supports at most {DRAFT_POSITIONS} positions "
                                         rf"\(max_position_embeddings\), but the target's max_model_len is {target_len}: "
                                         rf"lower max_model_len \(--max-model-len\) to {DRAFT_POSITIONS} or less"):
        LLM(target, dtype="float32", skip_tokenizer_init=True, speculative_config=spec(draft), **kwargs)


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
