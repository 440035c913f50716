"""Long bench runs show their progress on stderr, as `bench serve` and `bench throughput` do;
``--disable-tqdm`` hides it, and the results on stdout are the same either way."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from runtime.bench import multi_turn
from runtime.bench.step_overhead import tiny_config_folder

COMMON = ["--load-format", "dummy", "--dtype", "float32", "--skip-tokenizer-init", "--platform", "cpu"]


def bench(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "runtime.cli.main", "bench", *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_config_folder(hidden=64, layers=2, vocab=512)


def test_latency_shows_its_warmup_and_timed_runs(model):
    args = ["latency", "--model", model, *COMMON, "--input-len", "4", "--output-len", "4", "--batch-size", "2",
            "--num-iters", "2", "--num-iters-warmup", "1"]
    shown = bench(*args)
    assert "Warmup iterations: 100%" in shown.stderr and "1/1" in shown.stderr, shown.stderr[-2000:]
    assert "Profiling iterations: 100%" in shown.stderr and "2/2" in shown.stderr, shown.stderr[-2000:]
    assert "TTFT ms" in shown.stdout
    hidden = bench(*args, "--disable-tqdm")
    assert "iterations" not in hidden.stderr and "TTFT ms" in hidden.stdout


def test_step_overhead_shows_its_decode_steps():
    args = ["step-overhead", "--num-requests", "4", "--output-len", "8", "--cpu-num-threads", "1"]
    shown = bench(*args)
    assert "decode steps: 100%" in shown.stderr and "8/8" in shown.stderr, shown.stderr[-2000:]
    assert "4 running requests" in shown.stdout
    assert "decode steps" not in bench(*args, "--disable-tqdm").stderr


@pytest.mark.parametrize("disable", [False, True])
def test_multi_turn_shows_the_turns_answered(model, capsys, disable):
    parser = argparse.ArgumentParser()
    multi_turn.add_arguments(parser)
    args = parser.parse_args([
        "--model", model, *COMMON, "--block-size", "4", "--num-conversations", "2", "--num-turns", "2",
        "--system-len", "8", "--user-len", "4", "--output-len", "2", "--offload-modes", "none", "--think-time", "0.1",
        *(["--disable-tqdm"] if disable else []),
    ])
    assert multi_turn.main(args) == 0
    out, err = capsys.readouterr()
    assert "none" in out
    if disable:
        assert "turns (none)" not in err
    else:
        assert "turns (none): 100%" in err and "4/4" in err, err[-2000:]


def test_throughput_shows_the_transformers_peers_requests_too(model):
    args = ["throughput", "--model", model, *COMMON, "--num-prompts", "4", "--input-len", "4,8", "--output-len", "3,5",
            "--backends", "runtime,hf", "--hf-batch-size", "2"]
    shown = bench(*args)
    assert "Processed prompts: 100%" in shown.stderr, shown.stderr[-2000:]
    assert "transformers requests: 100%" in shown.stderr and "4/4" in shown.stderr, shown.stderr[-2000:]
    hidden = bench(*args, "--quiet")
    assert "transformers requests" not in hidden.stderr and "Processed prompts" not in hidden.stderr
