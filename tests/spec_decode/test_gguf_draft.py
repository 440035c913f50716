"""GGUF draft models: ``"model"`` may name a .gguf file or a folder holding one, as for the target.

A tiny qwen2 checkpoint is written both as a Hugging Face folder and as a GGUF file (float32,
the same weights); the GGUF copy drafting for the folder must have every draft accepted, and
a GGUF target with a GGUF draft of other weights must still give the target's greedy tokens.
"""

from __future__ import annotations

import gc
import os

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import UNTOKENIZED_VOCAB_SIZE, build_untokenized_model
from runtime.testing.reference import check_outputs_equal

from spec_decode.gguf_models import write_qwen2_gguf
from spec_decode.engine_runs import generate, repetitive_prompts, spec_counts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(dtype="float32", skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Paths of the checkpoints, the prompts and the greedy tokens of each target without speculation."""
    root = tmp_path_factory.mktemp("gguf_draft")
    paths = {"folder": build_untokenized_model("qwen2", root / "hf")}
    paths["gguf"] = write_qwen2_gguf(paths["folder"], root / "gguf" / "tiny-qwen2-f32.gguf")
    other = build_untokenized_model("qwen2", root / "other_hf", seed=1)
    paths["other_gguf"] = write_qwen2_gguf(other, root / "other_gguf" / "other-f32.gguf")
    prompts = repetitive_prompts(UNTOKENIZED_VOCAB_SIZE)
    expected = {}
    for name in ("folder", "gguf"):
        llm = LLM(paths[name], **ENGINE)
        expected[name] = [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)]
        del llm
        gc.collect()
    return paths, prompts, expected


@pytest.mark.parametrize("target,draft,all_accepted", [
    ("folder", "gguf_folder", True),  # the GGUF copy of the target, named by its folder
    ("gguf", "other_gguf", False),  # a GGUF draft of other weights, named by its file
])
def test_gguf_draft_greedy_identical(qwen2, target, draft, all_accepted):
    paths, prompts, expected = qwen2
    draft_path = os.path.dirname(paths["gguf"]) if draft == "gguf_folder" else paths[draft]
    config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 3}
    llm = LLM(paths[target], speculative_config=config, **ENGINE)
    check_outputs_equal(expected[target], [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)],
                        f"{target} target, {draft} draft")
    drafted, accepted = spec_counts(llm)
    assert drafted > 0 and (accepted == drafted if all_accepted else accepted < drafted), (drafted, accepted)
    del llm
    gc.collect()


def test_gguf_draft_with_another_vocabulary_is_refused(qwen2, tmp_path):
    small = build_untokenized_model("qwen2", tmp_path / "hf_256", vocab_size=256)
    small_gguf = write_qwen2_gguf(small, tmp_path / "gguf_256" / "small.gguf")
    with pytest.raises(ValueError, match="vocab_size 256, the target model 512.*share the target's tokenizer"):
        LLM(qwen2[0]["folder"], **ENGINE, speculative_config={"method": "draft_model", "model": small_gguf, "num_speculative_tokens": 2})
