"""The kernels compile for an H100 (sm_90), checked without a GPU.

The interpreter runs kernels as Python and misses compile-time errors (loop-carried
types, dot shapes, unsupported ops). ``kernel_aot.py`` compiles each kernel ahead of
time for ``cuda:90`` with Triton's bundled LLVM and ptxas, in a subprocess because one
process cannot mix interpreted and compiled Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "kernel_aot.py")
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "all kernels compiled for sm_90" in result.stdout
