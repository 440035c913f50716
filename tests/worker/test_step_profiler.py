"""RUNTIME_TORCH_PROFILER_DIR: a window of steps profiled in the worker, written per rank."""

from __future__ import annotations

import json

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.worker.profiling import step_profiler


def test_a_window_of_steps_is_profiled_and_written(tmp_path, monkeypatch):
    out = tmp_path / "profile"
    monkeypatch.setenv("RUNTIME_TORCH_PROFILER_DIR", str(out))
    monkeypatch.setenv("RUNTIME_TORCH_PROFILER_STEPS", "2:3")
    path = build_untokenized_model("llama", tmp_path / "llama")
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, enforce_eager=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    table = (out / "rank0.txt").read_text()
    assert table.startswith("steps 2..4\n") and "aten::" in table
    trace = json.loads((out / "rank0.trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])


def test_off_without_the_setting_and_a_bad_window_is_named(monkeypatch):
    monkeypatch.delenv("RUNTIME_TORCH_PROFILER_DIR", raising=False)
    assert step_profiler(0) is None
    monkeypatch.setenv("RUNTIME_TORCH_PROFILER_DIR", "/tmp/unused")
    monkeypatch.setenv("RUNTIME_TORCH_PROFILER_STEPS", "10")
    with pytest.raises(ValueError, match=r"RUNTIME_TORCH_PROFILER_STEPS must be FIRST:COUNT .* got '10'"):
        step_profiler(0)
