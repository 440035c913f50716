"""Weight-only 4/8-bit layers on the GPU: Triton kernels over the canonical packed layout.

Decode-sized batches of 4-bit weights (up to :data:`runtime_quant.w4a16_cuda.MAX_ROWS` rows)
take the CUDA GEMV of :mod:`runtime_quant.w4a16_cuda` where CuPy can compile it; other
decode-sized batches (at most :data:`GEMV_MAX_ROWS` rows) the dequantize-in-kernel Triton GEMV,
split along K so that a small layer still fills the GPU; larger batches take the
dequantize-tile + ``tl.dot`` GEMM, and from :data:`DEQUANT_MIN_ROWS` rows the layer is
dequantized into a reused scratch of ONE layer (:func:`scratch`: the largest layer's weights in
the activations' dtype, shared by all layers) and multiplied by cuBLAS, as GGUF layers do. The
weights stay packed in memory (4.25 bits a weight with group 128 float32 scales and uint8 zero
points); the scratch is never a copy of the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from runtime_quant import w4a16_cuda
from runtime_quant.w4a16_cuda import _num_sms  # the multiprocessors of a GPU (cached)
from runtime.envs import env_int

GEMV_MAX_ROWS = 4
# From this many rows: dequantize into the one-layer scratch, then cuBLAS. Provisional, from GGUF's
# H100 table (the same trade: 2 bytes a weight written and read back against a fused GEMM 3-5x
# slower than cuBLAS at 64-256 rows); RUNTIME_WNA16_DEQUANT_MIN_ROWS overrides.
DEQUANT_MIN_ROWS = env_int("RUNTIME_WNA16_DEQUANT_MIN_ROWS", 128, 1)
# Triton's interpreter turns float32 into bfloat16 wrongly inside a kernel (values ~1e10):
# there the GEMM multiplies in float32. Compiled kernels convert.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K_MAX = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def block_k(group_rows: int, in_features: int) -> int:
    """The K step: a power of two dividing the group (so a step never straddles two groups),
    at most :data:`BLOCK_K_MAX` and at least 16 codes."""
    if group_rows >= in_features:  # one group
        return BLOCK_K_MAX
    step = group_rows & -group_rows  # the largest power of two dividing it
    return min(step, BLOCK_K_MAX)


def supports(scheme, layer: torch.nn.Module) -> bool:
    return (
        layer.qweight.device.type == "cuda"
        and torch.cuda.is_available()
        and block_k(layer.quant_group_rows, layer.in_features) >= 16
    )


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int  # at most the group's power-of-two step (see block_k)
    split: int  # programs along K
    num_warps: int = 4


def gemv_config(n: int, k: int, group_rows: int, device: torch.device) -> GemvConfig:
    """Tiles of the decode GEMV. Many short programs: on an H200 every Llama-8B shape ran fastest
    (of column blocks 32-128, splits 1-16) with 128 columns and each program covering one or two
    128-row K blocks (``plugins/quant/bench/wna16_gpu.py --sweep``)."""
    step = block_k(group_rows, k)
    k_blocks = _cdiv(k, step)
    if device.type != "cuda":
        return GemvConfig(64, step, min(2, k_blocks))  # the interpreter: exercise the split path
    return GemvConfig(128, step, min(k_blocks, 16 if k <= 8192 else 32))


_LOCKS: dict[torch.device, torch.Tensor] = {}
_LOCK_SLOTS = 1 << 16


def _locks(device: torch.device) -> torch.Tensor:
    """Per-column-block counters of the split GEMV (zero between calls: the last split resets its own).
    Made on the first, eager call, before any CUDA graph captures one."""
    locks = _LOCKS.get(device)
    if locks is None:
        locks = _LOCKS[device] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)
    return locks


def wna16_gemv(layer: torch.nn.Module, bits: int, x: torch.Tensor, bias: torch.Tensor | None,
               config: GemvConfig | None = None) -> torch.Tensor:
    """``x`` [rows <= 4, K] @ the layer: the CUDA kernel where it applies, unless a Triton ``config``
    is given (benchmarks, tests), else the Triton GEMV."""
    from runtime_quant.jit_wna16 import wna16_gemv_kernel

    if config is None and w4a16_cuda.supports(layer, bits, x):
        return w4a16_cuda.gemv(layer, x, bias, _locks(x.device))
    qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
    rows, k = x.shape
    n = qweight.shape[1]
    c = config or gemv_config(n, k, layer.quant_group_rows, x.device)
    block_m = triton_next_power_of_2(rows)
    k_per_split = _cdiv(_cdiv(k, c.block_k), c.split) * c.block_k
    split = _cdiv(k, k_per_split)
    n_blocks = _cdiv(n, c.block_n)
    assert n_blocks <= _LOCK_SLOTS, f"{n} output features need more than {_LOCK_SLOTS} column blocks"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(split, block_m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    wna16_gemv_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, parts, _locks(x.device),
        rows, n, k, layer.quant_group_rows, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, num_warps=c.num_warps,
    )
    return out


def silu_and_mul_gemv(layer: torch.nn.Module, bits: int, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
    """``wna16_gemv(layer, bits, silu_and_mul(x), bias)`` in one CUDA launch for ``x`` [1-4, 2 K] =
    [gate | up], or None where the CUDA GEMV does not run it (shapes, dtype, device)."""
    if not w4a16_cuda.supports(layer, bits, x, w4a16_cuda.SILU_AND_MUL):
        return None
    return w4a16_cuda.silu_and_mul_gemv(layer, x, bias, _locks(x.device))


def rms_norm_gemv(layer: torch.nn.Module, bits: int, x: torch.Tensor, residual: torch.Tensor | None,
                  norm_weight: torch.Tensor, eps: float, gemma: bool,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(wna16_gemv(layer, bits, rms_norm(s)), s)`` with ``s = x + residual`` in one CUDA launch for
    ``x`` [1-4, K], or None where the CUDA GEMV does not run it."""
    prologue = w4a16_cuda.GEMMA_RMS_NORM if gemma else w4a16_cuda.RMS_NORM
    if not (w4a16_cuda.supports(layer, bits, x, prologue) and w4a16_cuda.norm_operands_fit(x, residual, norm_weight)):
        return None
    return w4a16_cuda.rms_norm_gemv(layer, x, residual, norm_weight, eps, gemma, bias, _locks(x.device))


def wna16_gemm(layer: torch.nn.Module, bits: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from runtime_quant.jit_wna16 import wna16_gemm_kernel

    qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
    rows, k = x.shape
    n = qweight.shape[1]
    step = block_k(layer.quant_group_rows, k)
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 64 if rows <= 32 else 128
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    wna16_gemm_kernel[(_cdiv(rows, block_m), _cdiv(n, block_n))](
        x, qweight, scales, zeros, bias if bias is not None else out, out, rows, n, k, layer.quant_group_rows,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=step, num_warps=4, num_stages=3,
    )
    return out


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer of at least ``numel`` elements: the largest layer dequantized so far (one
    layer's weights, never a copy of the model). Grown on eager calls (the warm-up's largest batch runs
    before any CUDA graph is captured)."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop((device, dtype), None)
        buf = _SCRATCH[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def wna16_dequantize_gpu(layer: torch.nn.Module, bits: int, dtype: torch.dtype, out: torch.Tensor | None = None,
                         block_n: int = 64) -> torch.Tensor:
    """The layer's ``W.T`` [K, N] in ``dtype``, into ``out`` or the one-layer scratch."""
    from runtime_quant.jit_wna16 import wna16_dequantize_kernel

    qweight, scales, zeros = layer.qweight, layer.scales, layer.zeros
    k, n = layer.in_features, qweight.shape[1]
    step = block_k(layer.quant_group_rows, k)
    if out is None:
        out = scratch(k * n, dtype, qweight.device).view(k, n)
    wna16_dequantize_kernel[(_cdiv(k, step), _cdiv(n, block_n))](
        qweight, scales, zeros, out, n, k, layer.quant_group_rows, qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, BLOCK_N=block_n, BLOCK_K=step, num_warps=4,
    )
    return out


def wna16_dequant_mm(layer: torch.nn.Module, bits: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] @ W.T for large batches: the layer dequantized into the one-layer scratch, then cuBLAS."""
    w_t = wna16_dequantize_gpu(layer, bits, x.dtype)
    if bias is None:
        return torch.mm(x, w_t)
    return torch.addmm(bias.to(x.dtype), x, w_t)


def triton_wna16(layer: torch.nn.Module, scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [T, in] -> [T, out]: the GEMV for up to :data:`GEMV_MAX_ROWS` rows, the GEMM below
    :data:`DEQUANT_MIN_ROWS`, else the layer dequantized into the scratch and cuBLAS."""
    x = x.contiguous()
    if x.shape[0] == 0:
        return torch.empty(0, layer.qweight.shape[1], dtype=x.dtype, device=x.device)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return wna16_gemv(layer, scheme.bits, x, bias)
    if x.shape[0] >= DEQUANT_MIN_ROWS:
        return wna16_dequant_mm(layer, scheme.bits, x, bias)
    return wna16_gemm(layer, scheme.bits, x, bias)
