"""The CUDA GEMV's programmatic dependent launch, marshalled for ``cuLaunchKernelEx`` (checked on
the CPU against a stand-in for the driver call): the launch configuration, the attribute that
allows the early start, every kernel argument at its address with its C type, and a refused launch
turning the feature off (plain launches from then on)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from runtime_quant import w4a16_cuda


class StandInKernel:
    ptr = 0x1234


def test_the_launch_hands_the_driver_the_grid_attribute_and_arguments(monkeypatch):
    seen = {}
    args = (0x7F00_0000_1000, 0, np.int32(4096), np.int32(-1), np.float32(1e-6), 0x7F00_0000_2000)

    def launch_kernel_ex(config_ref, function, params, extra):
        config = config_ref._obj
        attribute = config.attrs[0]
        seen.update(grid=tuple(config.grid), block=tuple(config.block), shared_mem=config.shared_mem, stream=config.stream,
                    attribute=(attribute.id, attribute.value, config.num_attrs), function=function, extra=extra)
        kinds = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64]
        seen["args"] = [ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value for i, kind in enumerate(kinds)]
        return 0

    monkeypatch.setattr(w4a16_cuda, "_launch_kernel_ex", lambda: launch_kernel_ex)
    monkeypatch.setattr(w4a16_cuda, "PDL", True)
    assert w4a16_cuda._launch_pdl(StandInKernel(), (150, 2), args, 8192, 0xABC)
    assert seen["grid"] == (150, 2, 1) and seen["block"] == (w4a16_cuda.THREADS, 1, 1)
    assert seen["shared_mem"] == 8192 and seen["stream"] == 0xABC and seen["function"] == 0x1234 and seen["extra"] is None
    assert seen["attribute"] == (w4a16_cuda._PROGRAMMATIC_STREAM_SERIALIZATION, 1, 1)
    assert seen["args"][:4] == [0x7F00_0000_1000, 0, 4096, -1] and seen["args"][5] == 0x7F00_0000_2000
    assert seen["args"][4] == pytest.approx(1e-6)
    assert w4a16_cuda.PDL


def test_a_refused_launch_turns_pdl_off(monkeypatch, caplog):
    monkeypatch.setattr(w4a16_cuda, "_launch_kernel_ex", lambda: lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(w4a16_cuda, "PDL", True)
    assert not w4a16_cuda._launch_pdl(StandInKernel(), (1, 1), (np.int32(1),), 0, 0)
    assert not w4a16_cuda.PDL and "CUresult 1" in caplog.text
