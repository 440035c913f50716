"""`runtime bench step-overhead` counts the model's forward pass as model time also when decode steps
run compiled code (the CPU platform's default) or replay graphs, which never call ``model.forward``."""

from __future__ import annotations

import time

from runtime.bench import step_overhead
from runtime.worker.graphs import DecodeGraphs

FORWARD_S = 0.05  # a forward pass made slow on purpose: far more than the engine's own time per step


def test_compiled_decode_steps_count_as_model_time(monkeypatch):
    monkeypatch.setenv("RUNTIME_CPU_COMPILE", "1")
    run = DecodeGraphs.run

    def slow_run(self, shape):
        time.sleep(FORWARD_S)
        return run(self, shape)

    monkeypatch.setattr(DecodeGraphs, "run", slow_run)
    result = step_overhead.measure(num_requests=4, prompt_len=8, output_len=9, warmup_steps=2, cpu_num_threads=1)
    assert result["steps_measured"] >= 3
    assert result["median_step_ms"] >= 1000 * FORWARD_S  # the steps did run the compiled forward
    assert result["median_overhead_ms"] < 1000 * FORWARD_S / 2, result
