"""The CUDA GEMVs' host side and their compilation, checked without a GPU:

* the dense one-row GEMV (``runtime_kernels/cuda/dense_gemv.cu``) compiles for sm_90 (nvcc, where it is
  installed) for every weight type, row shape and prologue, without spills;
* the occupancy is asked of the driver (a stand-in here), with a fallback where it cannot answer;
* programmatic dependent launch is marshalled for ``cuLaunchKernelEx`` as ``cuda.h`` lays it out: the
  structs' sizes and offsets against the header (a C compiler), and a stand-in for the driver call
  receiving the grid, the attributes and every argument at its C type; a refused launch turns it off;
* a launch in thread block clusters: the cluster dimension beside PDL; refused, nothing is launched (the
  caller has a kernel without clusters) and clusters go off;
* the settings' bad values are errors naming the variable, the value and what it takes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from runtime_kernels import cuda_launch, gemv_cuda


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_dense_gemv_compiles_for_sm90_without_spills(tmp_path):
    prologues = (gemv_cuda.PLAIN, gemv_cuda.SILU_AND_MUL, gemv_cuda.RMS_NORM, gemv_cuda.GEMMA_RMS_NORM)
    instances = []
    for x_type in gemv_cuda.ACTIVATION_TYPES.values():
        for w_type in (x_type, "dense_gemv::e4m3"):
            instances += [(x_type, w_type, rows, stretches, gemv_cuda.PLAIN) for rows, stretches in gemv_cuda.SHAPES]
            instances += [(x_type, w_type, *gemv_cuda.SHAPE, p) for p in prologues[1:]]
    _compile_for_sm90_without_spills(tmp_path, "dense_gemv.cu", [
        f"template __global__ void dense_gemv::gemv<{x_type}, {w_type}, {rows}, {stretches}, {p}>(const {x_type}*, "
        f"const {w_type}*, const float*, const {x_type}*, {x_type}*, int, int, long long, int, int, "
        f"const {x_type}*, const {x_type}*, {x_type}*, float);" for x_type, w_type, rows, stretches, p in instances])


def _compile_for_sm90_without_spills(tmp_path, source_name: str, instances: list[str]) -> None:
    """``instances`` (explicit instantiations) of ``runtime_kernels/cuda/<source_name>`` compile for sm_90
    through nvcc, and ptxas keeps every one in registers."""
    source = tmp_path / "instances.cu"
    source.write_text("\n".join([f'#include "{os.path.join(cuda_launch.include_dir(), source_name)}"', *instances]) + "\n")
    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", f"-I{cuda_launch.include_dir()}",
                             "-o", str(tmp_path / "k.cubin"), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    compiled = [line for line in result.stderr.splitlines() if "Compiling entry function" in line]
    assert len(compiled) == len(instances), result.stderr
    spills = [line for line in result.stderr.splitlines() if "spill" in line]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), result.stderr


def _cuda_header_dir() -> str | None:
    nvcc = shutil.which("nvcc")
    candidates = ([os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")] if nvcc else []) + [
        "/usr/local/cuda/include"]
    return next((d for d in candidates if os.path.exists(os.path.join(d, "cuda.h"))), None)


@pytest.mark.skipif(_cuda_header_dir() is None or shutil.which("cc") is None, reason="no cuda.h or C compiler")
def test_launch_structs_match_cuda_h(tmp_path):
    """The ctypes mirrors of CUlaunchConfig / CUlaunchAttribute have cuda.h's sizes and field offsets,
    and the attribute id is cuda.h's."""
    program = tmp_path / "layout.c"
    program.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n"
        "int main(void) { printf(\"%zu %zu %zu %zu %zu %zu %zu %d %d\\n\", sizeof(CUlaunchAttribute), "
        "offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), "
        "offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), "
        "(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION); "
        "return 0; }\n")
    binary = tmp_path / "layout"
    subprocess.run(["cc", f"-I{_cuda_header_dir()}", "-o", str(binary), str(program)], check=True, timeout=120)
    expected = [int(v) for v in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()]
    config, attribute = cuda_launch._LaunchConfig, cuda_launch._LaunchAttribute
    assert [ctypes.sizeof(attribute), attribute.value.offset, ctypes.sizeof(config), config.shared_mem.offset,
            config.stream.offset, config.attrs.offset, config.num_attrs.offset,
            cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION, cuda_launch.CLUSTER_DIMENSION] == expected


class StandInKernel:
    ptr = 0x1234

    def __init__(self):
        self.plain_launches = []

    def __call__(self, grid, block, args, shared_mem, stream):  # CuPy's plain launch
        self.plain_launches.append((grid, block, shared_mem, stream.ptr))


def test_the_launch_hands_the_driver_the_grid_attributes_and_arguments(monkeypatch):
    seen = {}
    args = (0x7F00_0000_1000, 0, np.int32(4096), np.int32(-1), np.float32(1e-6), 0x7F00_0000_2000, np.int64(-(1 << 40)))
    kinds = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64]

    def launch_kernel_ex(config_ref, function, params, extra):
        config = config_ref._obj
        attributes = [(config.attrs[i].id, tuple(config.attrs[i].value[:3])) for i in range(config.num_attrs)]
        seen.update(grid=tuple(config.grid), block=tuple(config.block), shared_mem=config.shared_mem, stream=config.stream,
                    attributes=attributes, function=function, extra=extra)
        seen["args"] = [ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value for i, kind in enumerate(kinds)]
        return 0

    monkeypatch.setattr(cuda_launch, "_launch_kernel_ex", lambda: launch_kernel_ex)
    assert cuda_launch._launch_ex(StandInKernel(), (150, 2), 256, args, 8192, 0xABC, True, None) == 0
    assert seen["grid"] == (150, 2, 1) and seen["block"] == (256, 1, 1)
    assert seen["shared_mem"] == 8192 and seen["stream"] == 0xABC and seen["function"] == 0x1234 and seen["extra"] is None
    assert seen["attributes"] == [(cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0))]
    assert seen["args"][:4] == [0x7F00_0000_1000, 0, 4096, -1] and seen["args"][5:] == [0x7F00_0000_2000, -(1 << 40)]
    assert seen["args"][4] == pytest.approx(1e-6)
    assert cuda_launch._launch_ex(StandInKernel(), (7,), 128, args, 0, 0, True, None) == 0 and seen["grid"] == (7, 1, 1)
    assert cuda_launch._launch_ex(StandInKernel(), (40, 7), 256, args, 0, 0, True, (1, 7, 1)) == 0
    assert seen["attributes"] == [(cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0)),
                                  (cuda_launch.CLUSTER_DIMENSION, (1, 7, 1))]
    assert cuda_launch._launch_ex(StandInKernel(), (40, 2), 256, args, 0, 0, False, (1, 2, 1)) == 0
    assert seen["attributes"] == [(cuda_launch.CLUSTER_DIMENSION, (1, 2, 1))]


@pytest.fixture
def sm90(monkeypatch):
    """``launch`` on a stand-in sm_90 GPU 0 (stream 0xABC) whose driver answers ``results`` in turn
    (CUresults; the attributes of each call recorded in ``calls``)."""
    from types import SimpleNamespace

    state = SimpleNamespace(results=[], calls=[])

    def launch_kernel_ex(config_ref, function, params, extra):
        config = config_ref._obj
        state.calls.append([config.attrs[i].id for i in range(config.num_attrs)])
        return state.results.pop(0)

    monkeypatch.setattr(cuda_launch, "_launch_kernel_ex", lambda: launch_kernel_ex)
    monkeypatch.setattr(cuda_launch, "_sm90", lambda index: True)
    monkeypatch.setattr(cuda_launch, "_pdl_refused", False)
    monkeypatch.setattr(cuda_launch, "_clusters_refused", False)
    monkeypatch.setattr(cuda_launch.torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=0xABC))
    monkeypatch.setattr(cuda_launch.torch.cuda, "current_device", lambda: 0)
    return state


PDL, CLUSTER = cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION, cuda_launch.CLUSTER_DIMENSION
GPU0 = torch.device("cuda", 0)


def test_a_refused_pdl_launch_launches_plainly_and_turns_pdl_off(sm90, caplog):
    kernel = StandInKernel()
    sm90.results = [1]  # CUDA_ERROR_INVALID_VALUE
    assert cuda_launch.pdl_available(0)
    assert cuda_launch.launch(kernel, (1, 1), 256, (np.int32(1),), 0, GPU0, pdl=True)
    assert sm90.calls == [[PDL]] and kernel.plain_launches == [((1, 1), (256,), 0, 0xABC)]
    assert cuda_launch._pdl_refused and not cuda_launch.pdl_available(0) and "CUresult 1" in caplog.text
    assert cuda_launch.launch(kernel, (1, 1), 256, (np.int32(1),), 0, GPU0, pdl=True)  # plain from now on
    assert sm90.calls == [[PDL]] and len(kernel.plain_launches) == 2


def test_a_refused_cluster_launch_launches_nothing_and_turns_clusters_off(sm90, caplog):
    kernel = StandInKernel()
    sm90.results = [0]
    assert cuda_launch.launch(kernel, (4, 2), 256, (np.int32(1),), 0, GPU0, pdl=True, cluster=(1, 2, 1))
    assert sm90.calls == [[PDL, CLUSTER]]
    sm90.results = [1, 0]  # refused with PDL, taken without: PDL goes off, clusters stay
    assert cuda_launch.launch(kernel, (4, 2), 256, (np.int32(1),), 0, GPU0, pdl=True, cluster=(1, 2, 1))
    assert sm90.calls[1:] == [[PDL, CLUSTER], [CLUSTER]]
    assert cuda_launch._pdl_refused and cuda_launch.clusters_available(0)
    sm90.results = [1]  # refused outright: the caller launches its kernel without clusters
    assert not cuda_launch.launch(kernel, (4, 2), 256, (np.int32(1),), 0, GPU0, cluster=(1, 2, 1))
    assert not cuda_launch.clusters_available(0) and "clusters of (1, 2, 1) failed (CUresult 1)" in caplog.text
    assert not cuda_launch.launch(kernel, (4, 2), 256, (np.int32(1),), 0, GPU0, cluster=(1, 2, 1))
    assert len(sm90.calls) == 4 and kernel.plain_launches == []


def test_occupancy_asks_the_driver_and_falls_back(monkeypatch):
    seen = {}

    def occupancy(blocks_ref, function, threads, shared_mem):
        seen.update(function=function, threads=threads, shared_mem=shared_mem)
        blocks_ref._obj.value = 3
        return 0

    monkeypatch.setattr(cuda_launch, "_occupancy", lambda: occupancy)
    assert cuda_launch.max_blocks_per_sm(StandInKernel(), 256, 28672, fallback=2) == 3
    assert seen == {"function": 0x1234, "threads": 256, "shared_mem": 28672}
    monkeypatch.setattr(cuda_launch, "_occupancy", lambda: lambda *args: 1)  # an error: the fallback
    assert cuda_launch.max_blocks_per_sm(StandInKernel(), 256, 0, fallback=2) == 2
    monkeypatch.setattr(cuda_launch, "_occupancy", lambda: None)  # no driver
    assert cuda_launch.max_blocks_per_sm(StandInKernel(), 256, 0, fallback=2) == 2


@pytest.mark.parametrize("name,value,message", [
    ("RUNTIME_GEMV_CUDA", "yes", "RUNTIME_GEMV_CUDA='yes': it takes 0 (off) or 1 (on)"),
    ("RUNTIME_GEMV_CUDA_PDL", "2", "RUNTIME_GEMV_CUDA_PDL='2': it takes 0 (off) or 1 (on)"),
    ("RUNTIME_GEMV_CUDA_PROLOGUES", "on", "RUNTIME_GEMV_CUDA_PROLOGUES='on': it takes 0 (off) or 1 (on)"),
    ("RUNTIME_GEMV_CUDA_SHAPE", "3,3", "RUNTIME_GEMV_CUDA_SHAPE='3,3': it takes rows,stretches, one of 2,8, 1,8, 4,4, 2,4"),
    ("RUNTIME_GEMV_CUDA_SHAPE", "two", "it takes rows,stretches"),
])
def test_bad_settings_are_named(name, value, message):
    result = subprocess.run([sys.executable, "-c", "import runtime_kernels.gemv_cuda"], capture_output=True, text=True,
                            env={**os.environ, name: value}, timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_nothing_takes_the_cuda_gemv_off_a_gpu(monkeypatch):
    import torch

    weight, x = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    if "RUNTIME_GEMV_CUDA" not in os.environ:
        assert not gemv_cuda.ENABLED  # opt-in: RUNTIME_GEMV_CUDA=1
    for enabled in (False, True):
        monkeypatch.setattr(gemv_cuda, "ENABLED", enabled)
        assert not gemv_cuda.takes(weight, torch.bfloat16) and not gemv_cuda.supports(x, weight)
