"""The 4/8-bit GPU kernels compile for an H100 (sm_90), checked without a GPU (the interpreter
misses compile-time errors): ``quant_aot.py`` in a subprocess, as ``tests/kernels`` does."""

from __future__ import annotations

import os

import pytest
from support.aot import run_aot_script

pytest.importorskip("triton")


def test_quant_kernels_compile_for_sm90():
    run_aot_script(os.path.join(os.path.dirname(__file__), "quant_aot.py"), "all quant kernels compiled for sm_90")
