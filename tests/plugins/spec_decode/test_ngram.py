"""runtime-plugin-spec-decode's ``ngram`` proposer: prompt lookup, its options and its registration."""

from __future__ import annotations

import pathlib
import random
import tomllib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import CacheConfig, DeviceConfig, EngineConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig
from runtime.spec_decode import DraftProposals, ProposalBatch, Proposer
from runtime_spec_decode.ngram import NgramProposer, propose_ngram

ROOT = pathlib.Path(__file__).resolve().parents[3]


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup one n and one start at a time: longest suffix n-gram, then its latest earlier occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # the occurrence ends before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(rows, k=3, min_n=1, max_n=3):
    batch = ProposalBatch(req_ids=[str(i) for i in range(len(rows))], token_ids=rows, num_speculative_tokens=k)
    out = NgramProposer(min_n, max_n).propose(batch)
    assert isinstance(out, DraftProposals) and out.probs is None
    return out.token_ids


# ------------------------------------------------------------------ hand-built cases


def test_longest_suffix_ngram_wins_over_a_later_shorter_one():
    # suffix 3-gram [1, 2, 3] occurs at 0 (followed by 10); the 1-gram [3] occurs later (followed by 20)
    tokens = [1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]
    assert propose([tokens], k=2) == [[10, 11]]
    assert propose([tokens], k=2, max_n=1) == [[20, 21]]


def test_most_recent_occurrence_wins():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]
    assert propose([tokens], k=1, min_n=2, max_n=2) == [[3]]


def test_drafts_are_truncated_at_the_end_of_the_sequence():
    assert propose([[4, 5, 6, 4, 5]], k=5, min_n=2, max_n=2) == [[6, 4, 5]]
    # an occurrence overlapping the suffix: [9, 9] ends at position 2, one token follows
    assert propose([[9, 9, 9, 9]], k=4, min_n=2, max_n=2) == [[9]]


def test_no_match_gives_no_drafts():
    assert propose([[1, 2, 3, 4], [5], [], [6, 6]], k=3, min_n=2, max_n=3) == [[], [], [], []]
    assert propose([[6, 6]], k=3, min_n=1, max_n=3) == [[6]]


def test_k_limits_the_drafts_and_zero_k_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose([tokens], k=3) == [[3, 4, 5]]
    assert propose([tokens], k=1) == [[3]]
    assert propose([tokens], k=0) == [[]]


def test_min_and_max_n_bound_the_ngram():
    tokens = [5, 1, 2, 6, 1, 2]  # only [1, 2] (n=2) and [2] (n=1) recur
    assert propose([tokens], k=1, min_n=3, max_n=4) == [[]]  # the 2-gram is too short
    assert propose([tokens], k=1, min_n=2, max_n=4) == [[6]]
    # with max_n = 1 the last [2] matches too; it is the same occurrence here
    assert propose([tokens], k=2, min_n=1, max_n=1) == [[6, 1]]
    # a long match counts as max_n: the most recent occurrence of the max_n-gram wins
    tokens = [1, 2, 3, 4, 9, 3, 4, 8, 1, 2, 3, 4]
    assert propose([tokens], k=1, min_n=1, max_n=2) == [[8]]
    assert propose([tokens], k=1, min_n=1, max_n=3) == [[9]]


def test_matches_never_reach_into_the_previous_request():
    # row 1's suffix [3, 1] would match at its start if row 0's last token (3) counted
    assert propose([[2, 3], [1, 3, 1]], k=2, min_n=2, max_n=3) == [[], []]
    assert propose([[1, 3, 1], [2, 3]], k=2, min_n=2, max_n=3) == [[], []]  # nor wrap around


def test_batch_rows_are_independent_and_keep_their_order():
    rows = [[1, 2, 1], [3, 3], [], [1, 2, 1, 2], np.array([4, 5, 4])]
    assert propose(rows, k=2) == [[2, 1], [3], [], [1, 2], [5, 4]]


# ------------------------------------------------------------------ property test


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=12),
    k=st.integers(0, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_batched_search_matches_the_reference(rows, k, min_n, extra):
    max_n = min_n + extra
    assert propose_ngram(rows, k, min_n, max_n) == [reference(r, k, min_n, max_n) for r in rows]


def test_many_short_rows_in_one_batch_match_the_reference():
    rng = random.Random(1)
    rows = [[rng.randrange(3) for _ in range(rng.randrange(0, 9))] for _ in range(3000)]
    for min_n, max_n in [(1, 1), (1, 3), (2, 4), (3, 3)]:
        assert propose_ngram(rows, 4, min_n, max_n) == [reference(r, 4, min_n, max_n) for r in rows]


def test_long_sequences_match_the_reference():
    rng = random.Random(0)
    rows = [[rng.randrange(20) for _ in range(rng.randrange(500, 3000))] for _ in range(16)]
    assert propose_ngram(rows, 5, 2, 4) == [reference(r, 5, 2, 4) for r in rows]


# ------------------------------------------------------------------ options


def engine_config(speculative_config=None) -> EngineConfig:
    model = ModelConfig(
        model="fake", tokenizer=None, dtype=torch.float32, max_model_len=128, seed=0,
        skip_tokenizer_init=True, served_model_name="fake", quantization=None, resolved=None,
    )
    options = {"speculative_method": "ngram", "num_speculative_tokens": 3}
    if speculative_config is not None:
        options["speculative_config"] = speculative_config
    return EngineConfig(model, CacheConfig(), SchedulerConfig(), ParallelConfig(), DeviceConfig("cpu"), LoadConfig(), options)


@pytest.mark.parametrize(
    "options,expected",
    [
        (None, (5, 5)),  # vLLM's defaults
        ({}, (5, 5)),
        ({"prompt_lookup_max": 4}, (4, 4)),
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 3}, (1, 3)),
    ],
)
def test_options_and_vllm_defaults(options, expected):
    proposer = NgramProposer.from_config(engine_config(options))
    assert (proposer.min_n, proposer.max_n) == expected


@pytest.mark.parametrize(
    "options,message",
    [
        ({"prompt_lookup_min": 0}, r"prompt_lookup_min must be an integer >= 1 \(valid: 1 <= prompt_lookup_min <= prompt_lookup_max\), got 0"),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": -2}, r"prompt_lookup_max must be an integer >= 1 .* got -2"),
        ({"prompt_lookup_max": "3"}, r"prompt_lookup_max must be an integer >= 1 .* got '3'"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
    ],
)
def test_bad_options_name_the_valid_range(options, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer.from_config(engine_config(options))


def test_options_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"plugin_options\['speculative_config'\] must be a mapping, got list"):
        NgramProposer.from_config(engine_config([1, 2]))


# ------------------------------------------------------------------ packaging and registration


def test_pyproject_entry_point():
    project = tomllib.loads((ROOT / "plugins" / "spec-decode" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "runtime-plugin-spec-decode"
    assert project["entry-points"]["runtime"] == {"spec_decode": "runtime_spec_decode"}
    assert "runtime" in project["dependencies"]


def test_entry_point_registers_ngram_which_satisfies_the_contract(plugin_manager):
    component = plugin_manager.registry("proposer").component("ngram")
    assert component.plugin == "spec_decode"
    info = plugin_manager.infos["spec_decode"]
    assert info.distribution == "runtime-plugin-spec-decode"
    assert info.registered == {"proposer": ["ngram", "draft_model", "eagle", "eagle3", "medusa"]}
    proposer = plugin_manager.registry("proposer").create("ngram", engine_config({"prompt_lookup_min": 2, "prompt_lookup_max": 3}))
    assert isinstance(proposer, Proposer)
    assert not getattr(proposer, "uses_kv_cache", False) and not getattr(proposer, "needs_hidden_states", False)
    batch = ProposalBatch(req_ids=["a", "b"], token_ids=[[1, 2, 3, 1, 2], [4]], num_speculative_tokens=2)
    assert proposer.propose(batch).token_ids == [[3, 1], []]
