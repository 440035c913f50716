"""Compiling and launching the CUDA kernels (``runtime_kernels/cuda/*.cu``; runtime-plugin-quant's 4-bit GEMV):
CuPy's NVRTC compiles them on first use for the GPU at hand (CuPy keeps the binaries on disk), and
:func:`launch` starts one on a torch stream, with programmatic dependent launch where asked
(``cuLaunchKernelEx`` through ctypes: on sm_90+ the kernel may start while the one before it ends;
it calls ``griddepcontrol.wait`` before it reads that kernel's results) and in thread block clusters
where asked (the blocks of a cluster read one another's shared memory).

Without CuPy, or where a kernel cannot compile, :func:`compile_kernels` returns None and the
callers keep their Triton kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterable
from importlib.resources import files
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def include_dir() -> str:
    """The folder of ``gemv_common.cuh`` and the other shared sources, for ``-I``."""
    return str(files("runtime_kernels") / "cuda")


def source(name: str) -> str:
    return (files("runtime_kernels") / "cuda" / name).read_text()


def compile_kernels(code: str, names: Iterable[str], device_index: int) -> dict[str, Any] | None:
    """``names`` (template instances, as C++ expressions) of ``code`` compiled for GPU ``device_index``:
    name -> CuPy function; None (logged) where CuPy is missing or the code does not compile."""
    names = list(names)
    try:
        import cupy

        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=code, options=("-std=c++17", f"-I{include_dir()}"), name_expressions=names)
            return {name: module.get_function(name).kernel for name in names}
    except Exception as exc:  # noqa: BLE001 - no CuPy or no NVRTC: the caller's Triton kernel runs
        logger.info("a CUDA kernel is unavailable (%s: %s); the Triton kernel runs", type(exc).__name__, exc)
        return None


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def fp8_conversions(device_index: int) -> bool:
    """Whether GPU ``device_index`` converts FP8 pairs to float16 in one instruction (cvt.rn.f16x2.e4m3x2: sm_89+)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def max_blocks_per_sm(kernel: Any, threads: int, shared_mem: int, fallback: int) -> int:
    """How many blocks of ``kernel`` (a CuPy function) a multiprocessor holds at once, by the driver's
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``, or ``fallback`` where it cannot tell."""
    occupancy, blocks = _occupancy(), ctypes.c_int(0)
    asked = occupancy is not None and hasattr(kernel, "ptr")
    if not asked or occupancy(ctypes.byref(blocks), kernel.ptr, threads, shared_mem) != 0 or blocks.value < 1:
        return fallback
    return blocks.value


def _occupancy():
    """The driver's ``cuOccupancyMaxActiveBlocksPerMultiprocessor``, or None."""
    return _driver_function("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                            (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t))


@functools.cache
def _driver_function(name: str, argtypes: tuple) -> Any:
    """Function ``name`` of the CUDA driver (returning a CUresult) with ``argtypes``, or None."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union of values
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` (CUDA 12+), or None."""
    return _driver_function("cuLaunchKernelEx", (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p))


_pdl_refused = False  # set once the driver refuses a programmatic dependent launch: plain launches from then on
_clusters_refused = False  # likewise for a launch in thread block clusters: the callers' kernels without clusters


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _launch_kernel_ex() is not None


def pdl_available(device_index: int) -> bool:
    """Whether programmatic dependent launch can be used on GPU ``device_index`` (sm_90+, a driver with
    ``cuLaunchKernelEx``, none refused so far)."""
    return not _pdl_refused and _sm90(device_index)


def clusters_available(device_index: int) -> bool:
    """Whether kernels can be launched in thread block clusters on GPU ``device_index`` (sm_90+, a driver
    with ``cuLaunchKernelEx``, none refused so far)."""
    return not _clusters_refused and _sm90(device_index)


def _launch_ex(kernel: Any, grid: tuple[int, ...], threads: int, args: tuple, shared_mem: int, stream: int,
               pdl: bool, cluster: tuple[int, int, int] | None) -> int:
    """Launch ``kernel`` (a CuPy function) through ``cuLaunchKernelEx`` with programmatic stream
    serialization (``pdl``) and/or the cluster dimension ``cluster``: the driver's CUresult."""
    values = [ctypes.c_float(a) if isinstance(a, np.float32) else ctypes.c_int32(a) if isinstance(a, np.int32)
              else ctypes.c_int64(a) if isinstance(a, np.int64) else ctypes.c_uint64(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    settings = ([(PROGRAMMATIC_STREAM_SERIALIZATION, (1,))] if pdl else []) + ([(CLUSTER_DIMENSION, cluster)] if cluster else [])
    attributes = (_LaunchAttribute * len(settings))()
    for attribute, (key, value) in zip(attributes, settings):
        attribute.id = key
        attribute.value[:len(value)] = value
    grid3 = (tuple(grid) + (1, 1))[:3]
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(threads, 1, 1), shared_mem, stream,
                           attributes, len(settings))
    return _launch_kernel_ex()(ctypes.byref(config), kernel.ptr, params, None) if hasattr(kernel, "ptr") else -1


class _Stream:
    """What CuPy's kernel launch reads of a stream: its handle, ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def launch(kernel: Any, grid: tuple[int, ...], threads: int, args: tuple, shared_mem: int, device: torch.device,
           pdl: bool = False, cluster: tuple[int, int, int] | None = None) -> bool:
    """Launch ``kernel`` on ``device``'s current torch stream; ``args``: device pointers as ints, scalars as
    ``np.int32`` / ``np.int64`` / ``np.float32``. ``pdl``: with programmatic dependent launch where the
    GPU and driver allow it. ``cluster``: in thread block clusters of these dimensions, which the kernel
    needs (check :func:`clusters_available` first): where the driver refuses them (logged once), nothing is
    launched and the result is False; else True."""
    stream = torch.cuda.current_stream(device).cuda_stream

    def go() -> bool:
        global _pdl_refused, _clusters_refused
        pdl_now = pdl and pdl_available(device.index)
        if cluster is not None:
            if not clusters_available(device.index):
                return False
            result = _launch_ex(kernel, grid, threads, args, shared_mem, stream, pdl_now, cluster)
            if result != 0 and pdl_now:  # the PDL attribute may be what the driver refuses
                result = _launch_ex(kernel, grid, threads, args, shared_mem, stream, False, cluster)
                _pdl_refused = _pdl_refused or result == 0
            if result != 0:
                logger.warning("cuLaunchKernelEx in clusters of %s failed (CUresult %d); kernels without clusters",
                               cluster, result)
                _clusters_refused = True
            return result == 0
        if pdl_now:
            result = _launch_ex(kernel, grid, threads, args, shared_mem, stream, True, None)
            if result == 0:
                return True
            logger.warning("cuLaunchKernelEx with programmatic dependent launch failed (CUresult %d); plain launches", result)
            _pdl_refused = True
        kernel(grid, (threads,), args, shared_mem=shared_mem, stream=_Stream(stream))
        return True

    if torch.cuda.current_device() == device.index:
        return go()
    with torch.cuda.device(device):  # a thread whose current device is another: launch in this GPU's context
        return go()
