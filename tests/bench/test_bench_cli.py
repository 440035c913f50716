"""`runtime bench latency` and `runtime bench throughput` end to end on a tiny dummy model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from runtime.bench.step_overhead import tiny_config_folder

COMMON = ["--load-format", "dummy", "--dtype", "float32", "--skip-tokenizer-init", "--platform", "cpu"]


def run_bench(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "bench", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_config_folder(hidden=64, layers=2, vocab=512)


def test_latency_reports_ttft_and_tpot_for_both_backends(model):
    out = run_bench("latency", "--model", model, *COMMON, "--input-len", "8", "--output-len", "6", "--batch-size", "2",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--backends", "runtime,hf")
    rows = {m.group(1): [float(x) for x in m.group(2).split()] for m in re.finditer(r"^(runtime|hf)\s+(.+)$", out, re.M)}
    assert set(rows) == {"runtime", "hf"}, out
    for latency, ttft_ms, tpot_ms, tokens in rows.values():
        assert latency > 0 and ttft_ms > 0 and tpot_ms > 0
        assert ttft_ms / 1000 < latency  # one token is quicker than six
        assert tokens == 6  # EOS ignored


def test_latency_on_code_editing_chats_with_speculating_peers(tmp_path):
    """--dataset code-edit: chat-templated prompts, answers ending at EOS (at most --output-len),
    the engine speculating by ngram and transformers by prompt lookup, batch 1."""
    from runtime.testing.models import smollm2_tokenizer

    folder = tiny_config_folder(hidden=64, layers=2, vocab=49152)
    smollm2_tokenizer().save_pretrained(folder)  # a real tokenizer with a chat template
    out = run_bench("latency", "--model", folder, "--load-format", "dummy", "--dtype", "float32", "--platform", "cpu",
                    "--dataset", "code-edit", "--output-len", "12", "--batch-size", "1", "--num-iters", "1",
                    "--num-iters-warmup", "0", "--backends", "runtime,hf", "--hf-prompt-lookup-num-tokens", "3",
                    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert re.search(r"batch 1 x \(code-editing chats of \d+-\d+ tokens, answers up to 12\)", out), out
    rows = {m.group(1): [float(x) for x in m.group(2).split()] for m in re.finditer(r"^(runtime|hf)\s+(.+)$", out, re.M)}
    assert set(rows) == {"runtime", "hf"}, out
    for latency, ttft_ms, tpot_ms, tokens in rows.values():
        assert latency > 0 and ttft_ms > 0 and tpot_ms > 0 and 1 <= tokens <= 12
        assert ttft_ms / 1000 < latency  # the first tokens are timed inside the same run
    assert re.search(r"runtime: speculative decoding, mean acceptance length (\S+)", out), out


def test_throughput_peer_on_a_prefix_of_the_workload(model):
    out = run_bench("throughput", "--model", model, *COMMON, "--num-prompts", "6", "--input-len", "4,8",
                    "--output-len", "3,5", "--backends", "runtime,hf", "--hf-num-prompts", "2", "--quiet")
    assert "transformers peers: the first 2 requests" in out
    requests = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(runtime|hf)\s+(\d+)\s", out, re.M)}
    assert requests == {"runtime": 6, "hf": 2}, out


@pytest.mark.parametrize("dtype, hf_dtype, expected", [("half", None, "float16"), ("float", None, "float32"),
                                                      ("auto", None, None), ("auto", "bfloat16", "bfloat16")])
def test_the_transformers_peer_runs_the_engines_dtype(model, dtype, hf_dtype, expected):
    """vLLM's dtype names and aliases; under auto (None) the dtype the engine resolves for the model."""
    import argparse

    import torch

    from runtime.bench.throughput import _hf_model
    from runtime.engine_args import EngineArgs, build_model_config
    from runtime.platforms import select_platform

    if expected is None:
        engine_args = EngineArgs(model=model, dtype=dtype, load_format="dummy", max_model_len=64)
        want = build_model_config(engine_args, select_platform("cpu")).dtype
    else:
        want = getattr(torch, expected)
    args = argparse.Namespace(model=model, dtype=dtype, hf_dtype=hf_dtype, load_format="dummy", seed=0, platform="cpu")
    assert _hf_model(args).dtype == want


def test_bad_peer_prefix_is_rejected(model):
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "bench", "throughput", "--model", model, *COMMON,
         "--num-prompts", "3", "--hf-num-prompts", "5", "--backends", "hf"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0 and "--hf-num-prompts must be in 1..3" in result.stderr


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_structured_throughput_reaches_the_engine_with_async_scheduling(tmp_path_factory, tmp_path, async_scheduling):
    pytest.importorskip("runtime_outlines")
    import json

    from runtime.testing.models import build_tiny_model

    model = build_tiny_model("llama", tmp_path_factory.mktemp("structured_bench"))  # SmolLM2's tokenizer
    report = tmp_path / "structured.json"
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    out = run_bench("throughput", "--model", model, "--load-format", "dummy", "--dtype", "float32", "--platform", "cpu",
                    "--structured-output", "json", "--num-prompts", "8", "--input-len", "4,8", "--output-len", "24,24",
                    "--backends", "runtime", "--quiet", flag, "--output-json", str(report))
    assert re.search(r"^runtime json\s+[\d.]+\s+[\d.]+$", out, re.M) and "constrained / unconstrained:" in out, out
    result = json.loads(report.read_text())
    assert len(result["lengths"]) == 8 and 0 <= result["valid"] <= 8
    # Both runs queue steps ahead with --async-scheduling (constrained ones too), none without.
    assert (result["num_steps_ahead"] > 0) == async_scheduling


@pytest.mark.parametrize("args, message", [
    (["throughput", "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["throughput", "--input-len", "many"], "a length range is 'MIN,MAX' (or one number) with 0 < MIN <= MAX, got 'many'"),
    (["throughput", "--backends", ","], "--backends names none; choose from runtime, hf, hf-batch"),
    (["latency", "--input-len", "0"], "--input-len must be >= 1, got 0"),
    (["latency", "--num-iters", "0"], "--num-iters must be >= 1, got 0"),
    (["latency", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_bad_workload_numbers_fail_before_the_model_loads(model, plugin_manager, capsys, args, message):
    from runtime.cli.main import main

    assert main(["bench", *args, "--model", model, *COMMON]) == 2
    err = capsys.readouterr().err
    assert f"runtime: error: {message}" in err and "Loading" not in err, err


def test_latency_workload_longer_than_max_model_len_is_a_clear_error(model, plugin_manager, capsys):
    """Random prompts must each generate --output-len tokens; a max_model_len without room for them is named
    (it was a bare AssertionError from inside the timed run)."""
    from runtime.cli.main import main

    assert main(["bench", "latency", "--model", model, *COMMON, "--input-len", "8", "--output-len", "12",
                 "--max-model-len", "16", "--batch-size", "1", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "runtime: error: --input-len 8 + --output-len 12 is more than max_model_len 16" in err, err[-2000:]


def test_throughput_workload_longer_than_max_model_len_is_a_clear_error(model, plugin_manager, capsys):
    """Every request runs to its output length (EOS ignored); one without room for it is named before the run (it
    was a bare AssertionError after the whole timed run)."""
    from runtime.cli.main import main

    assert main(["bench", "throughput", "--model", model, *COMMON, "--input-len", "8", "--output-len", "12",
                 "--max-model-len", "16", "--num-prompts", "2", "--backends", "runtime", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "runtime: error: a request of 20 tokens (prompt + output, from --input-len 8 and --output-len 12) is more " \
           "than max_model_len 16" in err, err[-2000:]


def test_step_overhead_too_short_to_measure_is_a_clear_error(plugin_manager, capsys):
    """Too few steps after the warm-up ones measured nothing: it was 'no median for empty data'."""
    from runtime.cli.main import main

    assert main(["bench", "step-overhead", "--num-requests", "4", "--output-len", "6", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "runtime: error: --num-requests must be >= 1 and --output-len >= 7 (5 warm-up steps, then measured ones " \
           "before the last), got 4 and 6" in err, err[-2000:]
