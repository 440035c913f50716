"""Ahead-of-time kernel compiles for an H100 (sm_90) without a GPU, run in a subprocess
(one process cannot mix interpreted and compiled Triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_aot_script(script: str, done_line: str) -> None:
    """Run ``script`` with ``TRITON_INTERPRET`` unset; it must succeed and print ``done_line``."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert done_line in result.stdout
