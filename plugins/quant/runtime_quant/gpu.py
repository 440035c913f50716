"""8-bit GEMMs on the GPU: cuBLASLt's FP8 GEMM with row-wise scales, and a Triton GEMM.

* :func:`fp8_scaled_mm`: FP8 weights per channel or per tensor (the canonical ``weight_scale``
  is one scale per output row either way) and per-token or per-tensor activations, through
  ``torch._scaled_mm`` with row-wise scales, bf16 out. Other activation dtypes, or shapes
  cuBLASLt refuses (dimensions not multiples of 16), take the reference.
* :func:`triton_scaled_gemm`: int8 W8A8 (int32 accumulation, exact) and block-wise FP8
  (activation groups of ``block_size[1]`` columns, weights in blocks), both with the scales
  applied inside the K loop or once at the end.

Activations are quantized per row by one Triton launch (:func:`_row_quantize`); before three of a
decoder layer's four linears that launch is the RMSNorm's or the SiLU-and-mul's own
(:func:`fp8_rms_norm_scaled_mm`, :func:`fp8_silu_and_mul_scaled_mm`).
"""

from __future__ import annotations

import functools
import os

import torch
from runtime.envs import env_flag

from runtime_quant.scheme import FP8, INT8, MIN_SCALE, W8A8Scheme, quant_max


@functools.cache
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def fp8_scaled_mm_supports(scheme: W8A8Scheme, device: torch.device) -> bool:
    return (
        _on_gpu(device)
        and scheme.weight_dtype == FP8
        and scheme.weight_strategy != "block"
        and scheme.activations in ("token", "tensor")
        and _fp8_tensor_cores(device.index or 0)
    )


def triton_scaled_gemm_supports(scheme: W8A8Scheme, device: torch.device) -> bool:
    if not _on_gpu(device) or scheme.activations is None:
        return False
    if scheme.weight_dtype == INT8:
        return scheme.weight_strategy != "block" and scheme.activations == "token"
    group = scheme.block_size[1] if scheme.block_size else 0
    return (
        scheme.weight_strategy == "block"
        and scheme.activations == "group"
        and group >= 16
        and group & (group - 1) == 0  # a power of two: one K step per group
        and _fp8_tensor_cores(device.index or 0)
    )


def _row_quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None, num_warps: int | None = None):
    """``x`` [T, in] -> (codes [T, in], float32 scales [T, 1]) in one launch; ``scale`` (a
    scalar tensor) for static activations. ``num_warps`` per row: the measured choice unless given
    (plugins/quant/bench/fp8_gpu.py compares them)."""
    from runtime_quant.jit_gemm import row_quantize_kernel

    rows, cols = x.shape
    codes = _codes_buffer(rows, cols, dtype, x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        row_quantize_kernel[(rows,)](
            x, codes, scales, scale if scale is not None else scales, cols, x.stride(0), codes.stride(0),
            QMIN=-128.0 if dtype == INT8 else -quant_max(dtype), QMAX=quant_max(dtype), MIN_SCALE=MIN_SCALE,
            STATIC=scale is not None, ROUND=dtype == INT8,
            BLOCK=min(4096, max(16, 1 << (cols - 1).bit_length())),
            # H100, 256 rows: 0.50 ms a step of the 8B model, 0.67 at 4 warps
            num_warps=num_warps or (16 if cols >= 8192 else 8),
        )
    return codes.to(dtype), scales


def _codes_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a kernel writes 8-bit codes of ``dtype``; ``.to(dtype)`` gives the codes. Triton's interpreter rounds
    to FP8 without carrying into the exponent (1.97 -> 1.0): there the kernel writes float32 codes and torch
    rounds them. Compiled kernels convert."""
    torch_rounds = dtype == FP8 and os.environ.get("TRITON_INTERPRET") == "1"
    return torch.empty(rows, cols, dtype=torch.float32 if torch_rounds else dtype, device=device)


def fp8_scaled_mm(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 W8A8 through cuBLASLt; a batch-1 step reads the FP8 weights in a one-row kernel
    instead (runtime-kernels' ``gemv`` with the row scales: weight-only for that one row, so
    no activation-quantization launch, and half of bf16's bytes)."""
    from runtime_quant.kernels import dequant_matmul

    n, k = layer.weight.shape
    if x.dtype != torch.bfloat16 or n % 16 or k % 16 or x.shape[0] == 0:
        return dequant_matmul(layer, scheme, x, bias)
    if x.shape[0] == 1 and layer.weight_scale.dim() == 1:
        from runtime_kernels.gemv import gemv  # runtime-plugin-cuda's kernels

        return gemv(x, layer.weight, bias, scale=layer.weight_scale)
    if scheme.activations == "token":
        codes, scale_a = _row_quantize(x, FP8)
    elif scheme.static_activations:
        codes, scale_a = _row_quantize(x, FP8, layer.input_scale)
    else:  # dynamic per tensor
        codes, scale_a = _row_quantize(x, FP8, (x.abs().amax().float() / quant_max(FP8)).clamp(min=MIN_SCALE).reshape(1))
    return _scaled_mm(layer, codes, scale_a, bias)


# cuBLASLt's fast FP8 accumulation: Hopper's tensor cores accumulate FP8 products in fewer bits than
# float32 unless the kernel promotes them along K; the fast kernels skip the promotion, as the CUTLASS
# FP8 kernels vLLM runs on sm90 do. W2 FP8 on one H200 (2026-11-29): 17,511 tok/s with it against 16,751
# and 16,812 without; against the float64 product of the same codes, the mean error at K = 14,336
# goes from 0.14 % (the bf16 output's rounding) to 0.28 % of the outputs' size (benchmarks/RESULTS.md).
# RUNTIME_FP8_FAST_ACCUM=0 turns it off.
FAST_ACCUM = env_flag("RUNTIME_FP8_FAST_ACCUM", True)


def _scaled_mm(layer: torch.nn.Module, codes: torch.Tensor, scale_a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch._scaled_mm(codes, layer.weight.t(), scale_a=scale_a, scale_b=layer.weight_scale.view(1, layer.weight.shape[0]),
                         out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    return y if bias is None else y + bias


# The op before an FP8 layer and the activations' quantization in one launch (a row per program, whole):
# for the per-token scheme on batches of 2+ rows, whose FP8 GEMM needs the codes anyway (one row reads
# the weights in runtime-kernels' gemv, with no quantization).
MAX_FUSED_COLUMNS = 16384
# On by default (W2 FP8 on two H200s, session 25: +1.4 % and +1.8 % in a pair swapped across the GPUs);
# RUNTIME_FP8_FUSED_QUANT=0 runs the ops apart.
FUSED_QUANT = env_flag("RUNTIME_FP8_FUSED_QUANT", True)


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm_quantize(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales [T, 1], s)``: the FP8 codes of ``rms_norm(s, weight)`` per row, ``s = x + residual``
    (``x`` itself without one), exactly as runtime-kernels' RMSNorm then :func:`_row_quantize` give them."""
    from runtime_quant.jit_gemm import rms_norm_quantize_kernel

    rows, hidden = x.shape
    summed = x if residual is None else torch.empty_like(x)
    codes = _codes_buffer(rows, hidden, FP8, x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = 1 << (hidden - 1).bit_length()
    if rows:
        rms_norm_quantize_kernel[(rows,)](
            x, residual if residual is not None else x, weight, summed, codes, scales,
            hidden, x.stride(0), residual.stride(0) if residual is not None else 0, summed.stride(0), codes.stride(0),
            eps, HAS_RESIDUAL=residual is not None, GEMMA=gemma, QMAX=quant_max(FP8), MIN_SCALE=MIN_SCALE,
            BLOCK_N=block, num_warps=_warps(block),
        )
    return codes.to(FP8), scales, summed


def silu_and_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales [T, 1])`` of ``silu(gate) * up`` for ``x`` [T, 2 d] = ``[gate | up]``, exactly as
    runtime-kernels' ``silu_and_mul`` then :func:`_row_quantize` give them."""
    from runtime_quant.jit_gemm import silu_and_mul_quantize_kernel

    rows, d = x.shape[0], x.shape[1] // 2
    codes = _codes_buffer(rows, d, FP8, x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = 1 << (d - 1).bit_length()
    if rows:
        silu_and_mul_quantize_kernel[(rows,)](
            x, codes, scales, d, x.stride(0), codes.stride(0), QMAX=quant_max(FP8), MIN_SCALE=MIN_SCALE, BLOCK=block,
            num_warps=_warps(block),
        )
    return codes.to(FP8), scales


def _fuses_op_before(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, k: int) -> bool:
    """Whether :func:`fp8_scaled_mm` of the op's output (``k`` columns) would quantize it per token for
    ``_scaled_mm``, and one program can hold a row."""
    n = layer.weight.shape[0]
    return (FUSED_QUANT and scheme.activations == "token" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 1
            and x.stride(-1) == 1 and n % 16 == 0 and k % 16 == 0 and k <= MAX_FUSED_COLUMNS and x.device.type == "cuda")


def fp8_rms_norm_scaled_mm(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, residual: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, gemma: bool,
                           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(fp8_scaled_mm(rms_norm(s)), s)`` with the norm and the quantization in one launch, or None where
    the layer's batch does not quantize per token (see :func:`_fuses_op_before`)."""
    if not _fuses_op_before(layer, scheme, x, x.shape[-1]) or (residual is not None and residual.stride(-1) != 1):
        return None
    codes, scales, summed = rms_norm_quantize(x, residual, norm_weight, eps, gemma)
    return _scaled_mm(layer, codes, scales, bias), summed


def fp8_silu_and_mul_scaled_mm(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor,
                               bias: torch.Tensor | None) -> torch.Tensor | None:
    """``fp8_scaled_mm(silu_and_mul(x))`` with the activation and the quantization in one launch, or None
    (see :func:`_fuses_op_before`)."""
    if not _fuses_op_before(layer, scheme, x, x.shape[-1] // 2):
        return None
    codes, scales = silu_and_mul_quantize(x)
    return _scaled_mm(layer, codes, scales, bias)


def fp8_gemv_weights(layer: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(weight, row scales)`` where :func:`fp8_scaled_mm` reads one row of ``dtype`` with
    runtime-kernels' gemv (bf16, both dimensions multiples of 16, one scale per row), else None."""
    n, k = layer.weight.shape
    if dtype != torch.bfloat16 or n % 16 or k % 16 or layer.weight_scale.dim() != 1:
        return None
    return layer.weight, layer.weight_scale


def _group_quantize(x: torch.Tensor, dtype: torch.dtype, group: int):
    """``x`` [T, in] -> (codes [T, in], float32 scales [T, ceil(in / group)])."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % group)).view(rows, -1, group)
    scale = (padded.abs().amax(dim=-1) / quant_max(dtype)).clamp(min=MIN_SCALE)  # [T, groups]
    codes = (padded / scale[:, :, None]).clamp(-quant_max(dtype), quant_max(dtype))
    return codes.view(rows, -1)[:, :cols].to(dtype), scale


def triton_scaled_gemm(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from runtime_quant.jit_gemm import scaled_gemm_kernel

    weight, weight_scale = layer.weight, layer.weight_scale
    n, k = weight.shape
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if scheme.weight_strategy == "block":
        group = scheme.block_size[1]
        codes, scale_a = _group_quantize(x, FP8, group)
        block_k = group
    else:
        codes, scale_a = _row_quantize(x, INT8)
        group, block_k = 0, 64
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 64 if rows <= 32 else 128
    grid = (_cdiv(rows, block_m), _cdiv(n, block_n))
    scaled_gemm_kernel[grid](
        codes, weight, out, scale_a, weight_scale, bias if bias is not None else out,
        rows, n, k,
        codes.stride(0), weight.stride(0), out.stride(0), scale_a.stride(0), weight_scale.stride(0),
        HAS_BIAS=bias is not None, GROUP_K=group, IS_INT8=scheme.weight_dtype == INT8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
