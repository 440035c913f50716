"""`runtime bench serve` with bad inputs: a clear message and exit 2 before any request, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from support.remote_server import free_port


def bench_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli.main", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_no_server_running_is_a_clear_error():
    port = free_port()  # nothing listens there
    result = bench_serve("--port", str(port), "--num-prompts", "2")
    assert result.returncode == 2, result.stderr
    assert f"runtime: error: no server answers at http://127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--random-input-len", "0"], "--random-input-len and --random-output-len must be >= 1, got 0 and 64"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--metric-percentiles", "p99"], "--metric-percentiles must be comma-separated numbers, got 'p99'"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/no/such.json"], "--dataset-path '/no/such.json' is not a file"),
    (["--dataset-name", "random-ids", "--input-len", "0"], "a length range is 'MIN,MAX' with 0 < MIN <= MAX, got '0'"),
])
def test_bad_arguments_fail_before_the_server_is_asked(args, message):
    result = bench_serve("--port", str(free_port()), *args)
    assert result.returncode == 2 and f"runtime: error: {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_sharegpt_file_without_usable_conversations(tmp_path):
    from runtime.bench.serve import sharegpt_requests

    path = tmp_path / "short.json"
    path.write_text(json.dumps([{"conversations": [{"value": "hi"}, {"value": "yo"}]}, {"other": 1}, 3]))
    with pytest.raises(ValueError, match="holds no conversation long enough"):
        sharegpt_requests(str(path), SimpleNamespace(encode=lambda text, **kw: text.split()), 5, None, 0)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        sharegpt_requests(str(path), None, 5, None, 0)
