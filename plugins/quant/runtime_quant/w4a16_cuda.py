"""The 4-bit GEMV in CUDA (``w4a16_gemv.cu``) for 1-4 rows: decode steps of small batches (and
speculative verification) of GPTQ/AWQ/compressed-tensors layers, in packed half2 arithmetic (~2 instructions a weight against the Triton
GEMV's ~5.6; on an H100 the four Llama-3-8B layer shapes take 1.95 ms a token in all, the Triton
GEMV's 2.70). Compiled on its first call (an eager one: decode graphs are warmed before capture) by
CuPy's NVRTC; without CuPy, or where it cannot compile, :func:`supports` is False and the Triton
GEMV runs. ``RUNTIME_WNA16_CUDA_GEMV=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("RUNTIME_WNA16_CUDA_GEMV", "1") != "0"
THREADS = 256  # kThreads
CHUNK_ROWS = 128  # kChunkRows: the input rows a warp takes at a time
MAX_CHUNKS_PER_BLOCK = 16  # a block's rows of x: one 8-row word row a thread
KERNEL_MAX_ROWS = 4  # rows of x a call can take (each word is dequantized once for all of them)
# The rows the engine sends it (RUNTIME_WNA16_CUDA_GEMV_MAX_ROWS=1 keeps 2-4 rows on the Triton GEMV). On an
# H100, Llama-3-8B's four linears x 32 layers at 4 rows: 3.25 ms against the Triton GEMV's 8.40 (benchmarks/RESULTS.md).
MAX_ROWS = min(int(os.environ.get("RUNTIME_WNA16_CUDA_GEMV_MAX_ROWS", str(KERNEL_MAX_ROWS))), KERNEL_MAX_ROWS)
KERNEL_TYPES = {torch.bfloat16: "w4a16::bf16", torch.float16: "w4a16::f16"}


@dataclass(frozen=True)
class Variant:
    """A compiled shape of the kernel: ``columns`` a lane (4 or 2; a block has 32x as many) and the
    blocks an SM must hold at once (``min_blocks``: 2 caps a thread at 128 registers)."""

    columns: int
    min_blocks: int
    chunks_per_block: int = 8  # one chunk per warp

    @property
    def block_columns(self) -> int:
        return 32 * self.columns


VARIANTS = (Variant(4, 2), Variant(4, 1), Variant(2, 2), Variant(2, 3))
# The default: 2 columns a lane, 3 blocks an SM, 16 chunks a block had the lowest sum over Llama-3-8B's
# four layer shapes on an H100 (plugins/quant/bench/wna16_gpu.py --one-row; benchmarks/RESULTS.md).
# RUNTIME_WNA16_CUDA_GEMV_VARIANT="columns,min_blocks,chunks_per_block" picks another (benchmarks).
DEFAULT = Variant(*map(int, os.environ.get("RUNTIME_WNA16_CUDA_GEMV_VARIANT", "2,3,16").split(",")))
# Several rows keep more sums in registers: 2 blocks an SM (128 registers) hold 4 rows without spills.
MULTI_ROW = Variant(2, 2, 16)
if (DEFAULT.columns, DEFAULT.min_blocks) not in {(v.columns, v.min_blocks) for v in VARIANTS}:
    raise ValueError(f"RUNTIME_WNA16_CUDA_GEMV_VARIANT={DEFAULT.columns},{DEFAULT.min_blocks},...: columns and "
                     f"min_blocks must be one of {[(v.columns, v.min_blocks) for v in VARIANTS]}")


class _Stream:
    """What CuPy's kernel launch reads of a stream: its handle, ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


@functools.cache
def kernels(device_index: int, columns: int = DEFAULT.columns, min_blocks: int = DEFAULT.min_blocks,
            rows: int = 1) -> dict[torch.dtype, Any] | None:
    """One variant's kernel for ``rows`` rows per activation dtype, compiled and loaded for this GPU
    (only what is used is compiled; CuPy keeps the binaries on disk for later starts), or None
    (logged once)."""
    try:
        import cupy

        source = (files("runtime_quant") / "w4a16_gemv.cu").read_text()
        names = {dtype: f"w4a16::gemv<{name}, {columns}, {min_blocks}, {rows}>" for dtype, name in KERNEL_TYPES.items()}
        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=source, options=("-std=c++17",), name_expressions=list(names.values()))
            return {dtype: module.get_function(name).kernel for dtype, name in names.items()}
    except Exception as exc:  # noqa: BLE001 - no CuPy or no NVRTC: the Triton GEMV runs
        logger.info("the CUDA 4-bit GEMV is unavailable (%s: %s); the Triton GEMV runs", type(exc).__name__, exc)
        return None


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % nbytes == 0 and (t.stride(0) * t.element_size()) % nbytes == 0


def variant_for(rows: int) -> Variant:
    return DEFAULT if rows == 1 else MULTI_ROW


def supports(layer: torch.nn.Module, bits: int, x: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs ``x`` [1-4, K] through ``layer``: 4 bits, a 16-bit float ``x``,
    K a multiple of 128, groups of a multiple of 128 rows (or one group), N a multiple of 4, and
    rows of the packed tensors aligned for vector loads."""
    k, n = layer.in_features, layer.qweight.shape[1]
    group = layer.quant_group_rows
    return (
        ENABLED
        and bits == 4
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in KERNEL_TYPES
        and x.device.type == "cuda"
        and k % CHUNK_ROWS == 0
        and x.shape[1] == k
        and (group % CHUNK_ROWS == 0 or group >= k)
        and n % 4 == 0
        and x.is_contiguous() and x.data_ptr() % 16 == 0
        and _aligned(layer.qweight, 16) and _aligned(layer.scales, 16) and _aligned(layer.zeros, 4)
        and kernels(x.device.index if x.device.index is not None else torch.cuda.current_device(),
                    variant_for(x.shape[0]).columns, variant_for(x.shape[0]).min_blocks, x.shape[0]) is not None
    )


def gemv(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, locks: torch.Tensor,
         variant: Variant | None = None) -> torch.Tensor:
    """``x`` [M <= KERNEL_MAX_ROWS, K] (contiguous) @ the layer's weights (+ ``bias``) -> [M, N] in ``x``'s dtype.
    ``locks``: int32 counters, zero, at least one per block of columns (the kernel leaves them zero)."""
    rows = x.shape[0]
    variant = variant or variant_for(rows)
    qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
    k, n = layer.in_features, qweight.shape[1]
    num_chunks = k // CHUNK_ROWS
    chunks_per_block = min(variant.chunks_per_block, num_chunks)
    assert 0 < chunks_per_block <= MAX_CHUNKS_PER_BLOCK
    grid = (-(-n // variant.block_columns), -(-num_chunks // chunks_per_block))
    assert grid[0] <= locks.numel()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(grid[1], rows, n, dtype=torch.float32, device=x.device) if grid[1] > 1 else out
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    args = (
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
        bias.data_ptr() if bias is not None else 0, out.data_ptr(), parts.data_ptr(), locks.data_ptr(),
        np.int32(n), np.int32(k), np.int32(min(layer.quant_group_rows, k)), np.int32(chunks_per_block),
        np.int32(qweight.stride(0)), np.int32(scales.stride(0)), np.int32(zeros.stride(0)), np.int32(bias is not None),
    )
    kernel = kernels(x.device.index, variant.columns, variant.min_blocks, rows)[x.dtype]
    launch = functools.partial(kernel, grid, (THREADS,), args, shared_mem=rows * chunks_per_block * CHUNK_ROWS * 2,
                               stream=_Stream(torch.cuda.current_stream(x.device).cuda_stream))
    if torch.cuda.current_device() == x.device.index:
        launch()
    else:  # a thread whose current device is another: launch in this GPU's context
        with torch.cuda.device(x.device):
            launch()
    return out
