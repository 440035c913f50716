"""The kernels compile for an H100 (sm_90), checked without a GPU.

The interpreter runs kernels as Python and misses compile-time errors (loop-carried
types, dot shapes, unsupported ops). ``kernel_aot.py`` compiles each kernel ahead of
time for ``cuda:90`` with Triton's bundled LLVM and ptxas, in a subprocess because one
process cannot mix interpreted and compiled Triton.
"""

from __future__ import annotations

import os

import pytest
from support.aot import run_aot_script

pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    run_aot_script(os.path.join(os.path.dirname(__file__), "kernel_aot.py"), "all kernels compiled for sm_90")
