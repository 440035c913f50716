"""Fixtures of the offload tests: a tiny float32 checkpoint, and the conversations without
offload with transformers' greedy tokens for every prompt the engine saw."""

from __future__ import annotations

import pytest
from offload_conversations import NUM_NEW_TOKENS, close, make_llm, run_turns

from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import reference_outputs


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return build_untokenized_model("llama", tmp_path_factory.mktemp("kv_offload_llama"))


@pytest.fixture(scope="session")
def baseline(model_path):
    """The conversations without offload, and transformers' tokens for every turn's prompts."""
    llm = make_llm(model_path)
    turns, stats = run_turns(llm)
    close(llm)
    prompts = [prompt for turn in turns for prompt, _, _ in turn]
    reference = [tokens for tokens, _ in reference_outputs(model_path, prompts, NUM_NEW_TOKENS)]
    return turns, stats, reference
