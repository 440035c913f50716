"""``runtime serve`` fails fast, non-zero and with the reason, when it cannot start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from support.remote_server import SERVER_FLAGS, free_port

TIMEOUT_S = 240


def serve(model: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runtime.cli.main", "serve", model, "--port", str(free_port()), *SERVER_FLAGS, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_unknown_plugin_choice_fails_before_the_engine_starts(tiny_llama):
    result = serve(tiny_llama, "--attention-backend", "no_such_backend")
    assert result.returncode != 0
    assert "unknown attention backend 'no_such_backend'; installed: " in result.stderr
    assert "engine core process started" not in result.stderr


def test_missing_model_path():
    result = serve("/no/such/model")
    assert result.returncode != 0
    assert "/no/such/model" in result.stderr


def test_engine_startup_error_is_reported(tiny_llama, tmp_path):
    """Weights the engine process cannot load: the server prints the engine's error and exits 1."""
    from safetensors.torch import load_file, save_file

    broken = str(tmp_path / "broken")
    shutil.copytree(tiny_llama, broken)
    file = os.path.join(broken, "model.safetensors")
    weights = load_file(file)
    del weights["model.norm.weight"]
    save_file(weights, file, metadata={"format": "pt"})
    result = serve(broken)
    assert result.returncode == 1, result.stderr
    assert "engine core process started" in result.stderr
    assert "runtime: error: the engine failed to start" in result.stderr
    assert "model.norm.weight" in result.stderr.splitlines()[-1]
