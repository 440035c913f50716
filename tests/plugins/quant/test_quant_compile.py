"""The 4/8-bit GPU kernels compile for an H100 (sm_90), checked without a GPU (the interpreter
misses compile-time errors): the Triton ones through ``quant_aot.py`` in a subprocess, as
``tests/kernels`` does; the CUDA one through nvcc, where it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from support.aot import run_aot_script

pytest.importorskip("triton")


def test_quant_kernels_compile_for_sm90():
    run_aot_script(os.path.join(os.path.dirname(__file__), "quant_aot.py"), "all quant kernels compiled for sm_90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_cuda_gemv_compiles_for_sm90_without_spills(tmp_path):
    """Every variant of the CUDA 4-bit GEMV for one row, and the multi-row one for 2-4 rows, with
    every prologue for one row and for 4 (both activation dtypes), with and without thread block
    clusters, compiles for sm_90, and ptxas
    keeps it in registers: a spill would put the weights in flight into local memory."""
    from runtime_quant import w4a16_cuda

    source = tmp_path / "instances.cu"
    lines = [f'#include "{os.path.join(os.path.dirname(w4a16_cuda.__file__), "w4a16_gemv.cu")}"']
    prologues = (w4a16_cuda.PLAIN, w4a16_cuda.SILU_AND_MUL, w4a16_cuda.RMS_NORM, w4a16_cuda.GEMMA_RMS_NORM)
    most = w4a16_cuda.KERNEL_MAX_ROWS  # the prologues at the most rows (the most registers) stand for 2-3 rows
    shapes = ([(v, 1, w4a16_cuda.PLAIN) for v in w4a16_cuda.VARIANTS]
              + [(w4a16_cuda.DEFAULT, 1, p) for p in prologues[1:]]
              + [(w4a16_cuda.MULTI_ROW, rows, w4a16_cuda.PLAIN) for rows in range(2, most + 1)]
              + [(w4a16_cuda.MULTI_ROW, most, p) for p in prologues[1:]])
    shapes = [(v, rows, p, cluster) for v, rows, p in shapes for cluster in (0, 1)]  # each also in thread block clusters
    for name in w4a16_cuda.KERNEL_TYPES.values():
        for v, rows, p, cluster in shapes:
            lines.append(f"template __global__ void w4a16::gemv<{name}, {v.columns}, {v.min_blocks}, {rows}, {p}, {cluster}>(const {name}*, "
                         "const unsigned int*, const float*, const unsigned char*, const " + name + "*, " + name + "*, "
                         f"float*, int*, int, int, int, int, int, int, int, int, int, const {name}*, const {name}*, {name}*, "
                         "float);")
    source.write_text("\n".join(lines) + "\n")
    from runtime_kernels.cuda_launch import include_dir

    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", f"-I{include_dir()}", "-o",
                             str(tmp_path / "k.cubin"), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    compiled = [line for line in result.stderr.splitlines() if "Compiling entry function" in line]
    assert len(compiled) == len(w4a16_cuda.KERNEL_TYPES) * len(shapes), result.stderr
    spills = [line for line in result.stderr.splitlines() if "spill" in line]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), result.stderr
