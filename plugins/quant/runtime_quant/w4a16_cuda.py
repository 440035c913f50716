"""The 4-bit GEMV in CUDA (``w4a16_gemv.cu``) for 1-4 rows: decode steps of small batches (and
speculative verification) of GPTQ/AWQ/compressed-tensors layers, in packed half2 arithmetic (~2
instructions a weight against the Triton GEMV's ~5.6; on an H100 the four Llama-3-8B layer shapes
take 1.95 ms a token in all, the Triton GEMV's 2.70).

In one-row steps it also computes the RMSNorm or SiLU-and-mul before the layer as it reads its input
(:func:`rms_norm_gemv`, :func:`silu_and_mul_gemv`), and in CUDA graphs is launched with programmatic
dependent launch on sm_90+ (``cuLaunchKernelEx`` through ctypes): with the ops folded in, a layer's GEMVs
follow one another, and each requests its first weights before the previous one ends (W3 4-bit on
an H100: 2.96 ms a token against 3.10 without either; benchmarks/RESULTS.md).

On sm_90+ a layer's blocks along K run as one thread block cluster, whose first block adds the others'
partial sums from their shared memory (W3 4-bit on an H200: 2.40 ms a token against 2.45 with the sums
through global memory).

Compiled on its first call (an eager one: decode graphs are warmed before capture) by CuPy's NVRTC;
without CuPy, or where it cannot compile, :func:`supports` is False and the Triton GEMV runs.
``RUNTIME_WNA16_CUDA_GEMV=0`` turns it off.
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

from runtime.envs import env_flag, env_int

logger = logging.getLogger(__name__)

ENABLED = env_flag("RUNTIME_WNA16_CUDA_GEMV")
THREADS = 256  # kThreads
CHUNK_ROWS = 128  # kChunkRows: the input rows a warp takes at a time
MAX_CHUNKS_PER_BLOCK = 16  # a block's rows of x: one 8-row word row a thread
KERNEL_MAX_ROWS = 4  # rows of x a call can take (each word is dequantized once for all of them)
# The rows the engine sends it (RUNTIME_WNA16_CUDA_GEMV_MAX_ROWS=1 keeps 2-4 rows on the Triton GEMV). On an
# H100, Llama-3-8B's four linears x 32 layers at 4 rows: 3.25 ms against the Triton GEMV's 8.40 (benchmarks/RESULTS.md).
MAX_ROWS = env_int("RUNTIME_WNA16_CUDA_GEMV_MAX_ROWS", KERNEL_MAX_ROWS, 1, KERNEL_MAX_ROWS)
KERNEL_TYPES = {torch.bfloat16: "gemv_common::bf16", torch.float16: "gemv_common::f16"}
# The kernel's prologues (its template P): the op before the layer computed as x is read (decode steps), so
# that a norm or the MLP's SiLU needs no launch of its own. RUNTIME_WNA16_CUDA_GEMV_PROLOGUES=0: ops apart.
PLAIN, SILU_AND_MUL, RMS_NORM, GEMMA_RMS_NORM = 0, 1, 2, 3
PROLOGUES = env_flag("RUNTIME_WNA16_CUDA_GEMV_PROLOGUES")
PROLOGUE_MAX_ROWS = env_int("RUNTIME_WNA16_CUDA_GEMV_PROLOGUE_MAX_ROWS", 1, 0, KERNEL_MAX_ROWS)  # measured: 4 rows lose
ONE_WAVE = env_flag("RUNTIME_WNA16_CUDA_GEMV_ONE_WAVE")  # see column_blocks
# Programmatic dependent launch on sm_90+ (the kernel's first weight loads overlap the previous kernel's end);
# RUNTIME_WNA16_CUDA_GEMV_PDL=0: plain launches.
PDL = env_flag("RUNTIME_WNA16_CUDA_GEMV_PDL")
# The blocks along K as a thread block cluster on sm_90+ (at most 8 of them: the portable cluster size): the first
# adds the others' partial sums from their shared memory instead of the last to finish reading them back from global
# memory after a fence and an atomic. RUNTIME_WNA16_CUDA_GEMV_CLUSTERS=0: the global-memory sum everywhere.
CLUSTERS = env_flag("RUNTIME_WNA16_CUDA_GEMV_CLUSTERS")
MAX_CLUSTER = 8


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
# The default: 2 columns a lane, 2 blocks an SM, 16 chunks a block. Alone, over Llama-3-8B's four layer shapes
# (plugins/quant/bench/wna16_gpu.py --one-row, one H100), 2,3,16 had the lowest sum in one run and 2,2,16 in a
# later one; in the W3 step, with the prologues and PDL, 2,2,16 took 2.85-2.86 ms a token against 2.98-2.99 for 2,3,16
# (alternating, one call: benchmarks/RESULTS.md, session 20).
# RUNTIME_WNA16_CUDA_GEMV_VARIANT="columns,min_blocks,chunks_per_block" picks another (benchmarks).


def _variant_setting(text: str, name: str = "RUNTIME_WNA16_CUDA_GEMV_VARIANT") -> Variant:
    """Setting ``name``'s "columns,min_blocks,chunks_per_block", checked."""
    shapes = [(v.columns, v.min_blocks) for v in VARIANTS]
    fields = text.split(",")
    if len(fields) != 3 or not all(f.strip().isdigit() for f in fields):
        raise ValueError(f"{name}={text!r}: it takes columns,min_blocks,chunks_per_block (e.g. 2,2,16)")
    variant = Variant(*map(int, fields))
    if (variant.columns, variant.min_blocks) not in shapes or not 1 <= variant.chunks_per_block <= MAX_CHUNKS_PER_BLOCK:
        raise ValueError(f"{name}={text!r}: columns,min_blocks must be one of {shapes} and "
                         f"chunks_per_block from 1 to {MAX_CHUNKS_PER_BLOCK}")
    return variant


DEFAULT = _variant_setting(os.environ.get("RUNTIME_WNA16_CUDA_GEMV_VARIANT", "2,2,16"))
# One-row layers of at least LARGE_WEIGHTS weights (Llama-3-8B's gate_up and down, not qkv and o) take 4 columns a lane:
# on an H200 alone 21.3 / 12.2 µs against 23.2 / 14.3 at 2 (qkv and o lose at 4: 8.4 / 7.4 against 7.2 / 5.8), and W3
# 4-bit 2.34 ms a token against 2.40-2.41 (benchmarks/RESULTS.md, session 23).
# RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT="columns,min_blocks,chunks_per_block" picks another ("" : the default's).
LARGE_WEIGHTS = 32 << 20
_LARGE_SETTING = os.environ.get("RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT", "4,2,16")
LARGE = _variant_setting(_LARGE_SETTING, "RUNTIME_WNA16_CUDA_GEMV_LARGE_VARIANT") if _LARGE_SETTING else None
# Several rows keep more sums in registers: 2 blocks an SM (128 registers) hold 4 rows without spills.
MULTI_ROW = Variant(2, 2, 16)


@functools.cache
def kernels(device_index: int, columns: int = DEFAULT.columns, min_blocks: int = DEFAULT.min_blocks,
            rows: int = 1, prologue: int = PLAIN, cluster: bool = False) -> dict[torch.dtype, Any] | None:
    """One variant's kernel for ``rows`` rows and ``prologue`` per activation dtype (``cluster``: the one
    launched in clusters of its blocks along K), compiled and loaded for this GPU (only what is used is
    compiled; CuPy keeps the binaries on disk for later starts), or None (logged once)."""
    from runtime_kernels import cuda_launch  # runtime-plugin-cuda's kernels: compiling and launching

    names = {dtype: f"w4a16::gemv<{name}, {columns}, {min_blocks}, {rows}, {prologue}, {int(cluster)}>"
             for dtype, name in KERNEL_TYPES.items()}
    compiled = cuda_launch.compile_kernels((files("runtime_quant") / "w4a16_gemv.cu").read_text(), names.values(),
                                           device_index)
    if compiled is None:
        logger.info("the CUDA 4-bit GEMV is unavailable; the Triton GEMV runs")
        return None
    return {dtype: compiled[name] for dtype, name in names.items()}


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % nbytes == 0 and (t.stride(0) * t.element_size()) % nbytes == 0


def _num_sms(device_index: int) -> int:
    from runtime_kernels.cuda_launch import num_sms

    return num_sms(device_index)


def column_blocks(runs: int, blocks_k: int, min_blocks: int, device_index: int) -> int:
    """Blocks along N for ``runs`` column runs: all of them where the GPU holds the whole grid at once
    (``min_blocks`` a multiprocessor), else as few rounds of runs per block as fit in one wave, the runs
    spread evenly (each block prepares its rows of x once for all its runs). RUNTIME_WNA16_CUDA_GEMV_ONE_WAVE=0:
    a block per run."""
    resident = _num_sms(device_index) * min_blocks
    if not ONE_WAVE or runs * blocks_k <= resident:
        return runs
    rounds = -(-runs * blocks_k // resident)
    return -(-runs // rounds)


def variant_for(rows: int, k: int = 0, n: int = 0) -> Variant:
    """The variant for ``rows`` rows of a [k, n] layer."""
    if rows > 1:
        return MULTI_ROW
    return LARGE if LARGE is not None and k * n >= LARGE_WEIGHTS else DEFAULT


def supports(layer: torch.nn.Module, bits: int, x: torch.Tensor, prologue: int = PLAIN) -> bool:
    """Whether the CUDA kernel runs ``x`` [1-4, K] ([1-4, 2 K] = [gate | up] with SILU_AND_MUL)
    through ``layer``: 4 bits, a 16-bit float ``x``, K a multiple of 128, groups of a multiple of
    128 rows (or one group), N a multiple of 4, and rows of the packed tensors aligned for vector
    loads."""
    k, n = layer.in_features, layer.qweight.shape[1]
    group = layer.quant_group_rows
    variant = variant_for(x.shape[0], k, n)
    return (
        ENABLED
        and (prologue == PLAIN or (PROLOGUES and x.shape[0] <= PROLOGUE_MAX_ROWS))
        and bits == 4
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in KERNEL_TYPES
        and x.device.type == "cuda"
        and k % CHUNK_ROWS == 0
        and x.shape[1] == (2 * k if prologue == SILU_AND_MUL else k)
        and (group % CHUNK_ROWS == 0 or group >= k)
        and n % 4 == 0
        and x.is_contiguous() and x.data_ptr() % 16 == 0
        and _aligned(layer.qweight, 16) and _aligned(layer.scales, 16) and _aligned(layer.zeros, 4)
        and kernels(x.device.index if x.device.index is not None else torch.cuda.current_device(),
                    variant.columns, variant.min_blocks, x.shape[0], prologue) is not None
    )


def norm_operands_fit(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    """Whether a norm prologue can read ``residual`` (x's shape) and ``norm_weight`` [K] as it reads ``x``."""
    return (
        norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype and norm_weight.device == x.device
        and norm_weight.is_contiguous() and norm_weight.data_ptr() % 16 == 0
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
                                  and residual.is_contiguous() and residual.data_ptr() % 16 == 0))
    )


def gemv(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, locks: torch.Tensor,
         variant: Variant | None = None, prologue: int = PLAIN, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``x`` [M <= KERNEL_MAX_ROWS, K] (contiguous) @ the layer's weights (+ ``bias``) -> [M, N] in ``x``'s dtype,
    ``x`` first put through ``prologue``: SILU_AND_MUL takes ``x`` [M, 2 K] = [gate | up]; the norms
    ``rms_norm(x + residual, norm_weight, eps)`` (``residual`` may be None), writing ``x + residual`` into
    ``residual_out`` (or not, None). ``locks``: int32 counters, zero, at least one per block of columns (the
    kernel leaves them zero)."""
    rows = x.shape[0]
    qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
    k, n = layer.in_features, qweight.shape[1]
    variant = variant or variant_for(rows, k, n)
    num_chunks = k // CHUNK_ROWS
    chunks_per_block = min(variant.chunks_per_block, num_chunks)
    assert 0 < chunks_per_block <= MAX_CHUNKS_PER_BLOCK
    runs, blocks_k = -(-n // variant.block_columns), -(-num_chunks // chunks_per_block)
    grid = (column_blocks(runs, blocks_k, variant.min_blocks, x.device.index), blocks_k)
    assert runs <= locks.numel()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()

    def args(parts: torch.Tensor) -> tuple:
        return (
            x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
            bias.data_ptr() if bias is not None else 0, out.data_ptr(), parts.data_ptr(), locks.data_ptr(),
            np.int32(n), np.int32(k), np.int32(min(layer.quant_group_rows, k)), np.int32(chunks_per_block),
            np.int32(qweight.stride(0)), np.int32(scales.stride(0)), np.int32(zeros.stride(0)), np.int32(bias is not None),
            np.int32(x.stride(0)), residual.data_ptr() if residual is not None else 0,
            norm_weight.data_ptr() if norm_weight is not None else 0,
            residual_out.data_ptr() if residual_out is not None else 0, np.float32(eps),
        )

    from runtime_kernels import cuda_launch

    shared_mem = rows * chunks_per_block * CHUNK_ROWS * 2
    # PDL where the prologues make a layer's GEMVs follow one another (measured to lose at 4 rows without them), in
    # CUDA graphs: an eager step is bound by its launches, which PDL's ctypes path makes slower
    overlap = PDL and PROLOGUES and rows <= PROLOGUE_MAX_ROWS and torch.cuda.is_current_stream_capturing()
    if CLUSTERS and 1 < grid[1] <= MAX_CLUSTER and cuda_launch.clusters_available(x.device.index):
        compiled = kernels(x.device.index, variant.columns, variant.min_blocks, rows, prologue, cluster=True)
        if compiled is not None and cuda_launch.launch(compiled[x.dtype], grid, THREADS, args(out), shared_mem, x.device,
                                                       pdl=overlap, cluster=(1, grid[1], 1)):
            return out
    parts = torch.empty(grid[1], rows, n, dtype=torch.float32, device=x.device) if grid[1] > 1 else out
    kernel = kernels(x.device.index, variant.columns, variant.min_blocks, rows, prologue)[x.dtype]
    cuda_launch.launch(kernel, grid, THREADS, args(parts), shared_mem, x.device, pdl=overlap)
    return out


def silu_and_mul_gemv(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                      locks: torch.Tensor) -> torch.Tensor:
    """``gemv(silu_and_mul(x))`` in one launch: ``x`` [M, 2 K] = [gate | up], the activation rounded to
    ``x``'s dtype as ``runtime_kernels.activation.silu_and_mul`` rounds it."""
    return gemv(layer, x, bias, locks, prologue=SILU_AND_MUL)


def rms_norm_gemv(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, gemma: bool, bias: torch.Tensor | None,
                  locks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(rms_norm(s, norm_weight, eps, gemma)), s)`` in one launch, ``s = x + residual`` (``x`` itself
    without a residual; else a new tensor), both rounded as ``runtime_kernels.norm`` rounds them."""
    summed = x if residual is None else torch.empty_like(x)
    out = gemv(layer, x, bias, locks, prologue=GEMMA_RMS_NORM if gemma else RMS_NORM, residual=residual,
               norm_weight=norm_weight, residual_out=None if residual is None else summed, eps=eps)
    return out, summed
