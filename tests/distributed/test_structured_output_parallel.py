"""Structured output over several worker processes (gloo on the CPU): the grammar's bitmask reaches the rank that
samples, so constrained tokens under tensor or pipeline parallelism (with async scheduling, prefix caching and a
small chunked-prefill budget) equal one worker's, and the outputs validate."""

from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest

from runtime import LLM, SamplingParams, StructuredOutputsParams
from runtime.testing.models import build_tiny_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = "[0-9]{3}-[a-c]{2}"
PROMPTS = ["Give me a person:", "Code:", "Hello there", "Another person:"]


def params() -> list[SamplingParams]:
    json_spec = StructuredOutputsParams(json=SCHEMA)
    return [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=json_spec),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=20),  # a free request in the same batch
        SamplingParams(temperature=0.8, seed=3, max_tokens=60, n=2, structured_outputs=json_spec),
    ]


def run(path, **settings) -> list[list[tuple[str, str]]]:
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=4, **settings)
    try:
        outputs = llm.generate(PROMPTS, params(), use_tqdm=False)
        return [[(c.text, c.finish_reason) for c in o.outputs] for o in outputs]
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("so_parallel"))
    expected = run(path)
    for text, reason in expected[0] + expected[3]:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, expected[1][0][0])
    return path, expected


@pytest.mark.parametrize("settings", [
    dict(tensor_parallel_size=2, async_scheduling=True),
    dict(pipeline_parallel_size=2, async_scheduling=True, enable_prefix_caching=True, max_num_batched_tokens=16),
], ids=["tp2-async", "pp2-async-prefix-chunked"])
def test_constrained_tokens_equal_one_worker(single, settings):
    path, expected = single
    assert run(path, **settings) == expected
