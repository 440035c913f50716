"""Quantize activations and compute 8-bit GEMMs; the kernel is chosen per layer by device.

After loading, every layer holds the same canonical tensors, whatever the checkpoint's
layout (see :meth:`runtime_quant.linear.W8A8LinearMethod.process_weights_after_loading`):

- ``weight`` [out, in], float8_e4m3fn or int8;
- ``weight_scale`` float32, [out] (one scale per output row) or, block-wise,
  [out, ceil(in / block_cols)] (each row's scale per column block);
- ``input_scale`` float32 [] for static activations, else absent.

``w_real = weight * weight_scale`` (per row, or per row and column block), and activations
are quantized the same way at run time (:func:`quantize_activations`).

:data:`KERNELS` is tried in order and the first :class:`Kernel` whose ``supports(scheme,
device)`` is true computes the layer: on a GPU ``torch._scaled_mm`` with row-wise scales or
a Triton GEMM (:mod:`runtime_quant.gpu`), on the CPU ``torch._int_mm``; the reference runs
on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime_quant import gpu
from runtime_quant.scheme import INT8, MIN_SCALE, W8A8Scheme, quant_max


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded to ``dtype`` codes (int8: round half to even), saturating at the
    type's range (int8: -128..127, as vLLM's and compressed-tensors' static quantization)."""
    q = x.float() / scale
    if dtype.is_floating_point:
        return q.clamp(-quant_max(dtype), quant_max(dtype)).to(dtype)
    return q.round().clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max).to(dtype)


def row_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row scales ``amax(|row|) / qmax`` of ``x`` [rows, cols] -> [rows, 1] float32."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / quant_max(dtype)).clamp(min=MIN_SCALE)


def group_scales(x: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """Per-row, per-``group``-columns scales of ``x`` [rows, cols] -> [rows, cols] float32
    (the last group may be short)."""
    rows, cols = x.shape
    pad = -cols % group
    padded = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, -1, group)
    scales = (padded.abs().amax(dim=-1) / quant_max(dtype)).clamp(min=MIN_SCALE)  # [rows, groups]
    return scales.repeat_interleave(group, dim=1)[:, :cols]


def quantize_activations(
    x: torch.Tensor, scheme: W8A8Scheme, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, in] -> (codes [T, in] in the weights' dtype, scales broadcastable to [T, in])."""
    dtype = scheme.weight_dtype
    if scheme.activations == "token":
        scale = row_scales(x, dtype)  # [T, 1]
    elif scheme.activations == "group":
        scale = group_scales(x, dtype, scheme.block_size[1])  # [T, in]
    elif scheme.static_activations:
        scale = input_scale  # []
    else:  # dynamic per tensor
        scale = (x.abs().amax().float() / quant_max(dtype)).clamp(min=MIN_SCALE)
    return quantize(x, scale, dtype), scale


def dequantized_weight(layer: torch.nn.Module, scheme: W8A8Scheme) -> torch.Tensor:
    """The layer's real-valued weight [out, in] in float32."""
    weight, scale = layer.weight, layer.weight_scale
    if scheme.weight_strategy == "block":
        cols = scheme.block_size[1]
        scale = scale.repeat_interleave(cols, dim=1)[:, : weight.shape[1]]  # [out, in]
        return weight.float() * scale
    return weight.float() * scale[:, None]


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def dequant_matmul(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: dequantize activations and weights to float32, then ``x @ W.T``."""
    if scheme.activations is None:
        x_real = x.float()
    else:
        codes, scale = quantize_activations(x, scheme, getattr(layer, "input_scale", None))
        x_real = codes.float() * scale
    return _finish(x_real @ dequantized_weight(layer, scheme).t(), bias, x.dtype)


def int_mm(layer: torch.nn.Module, scheme: W8A8Scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8 x int8 -> int32 (``torch._int_mm``, exact), then the row and channel scales."""
    codes, scale = quantize_activations(x, scheme, None)  # [T, in] int8, [T, 1]
    acc = torch._int_mm(codes, layer.weight.t())  # [T, out] int32
    return _finish(acc.float() * scale * layer.weight_scale, bias, x.dtype)


@dataclass(frozen=True)
class Kernel:
    name: str
    supports: Callable[[W8A8Scheme, torch.device], bool]
    run: Callable[[torch.nn.Module, W8A8Scheme, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (layer, dtype) -> (weight, row scales) where ``run`` reads one row with runtime-kernels' gemv
    gemv_weights: Callable[[torch.nn.Module, torch.dtype], tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # The op before the layer in the same launch as the activations' quantization (LinearMethod's
    # apply_rms_norm / apply_silu_and_mul, after the layer argument: the scheme, then theirs), or None
    after_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    after_silu_and_mul: Callable[..., torch.Tensor | None] | None = None


def _int_mm_supports(scheme: W8A8Scheme, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and hasattr(torch, "_int_mm")
        and scheme.weight_dtype == INT8
        and scheme.weight_strategy != "block"
        and scheme.activations == "token"
    )


KERNELS: list[Kernel] = [
    Kernel("fp8_scaled_mm", gpu.fp8_scaled_mm_supports, gpu.fp8_scaled_mm, gpu.fp8_gemv_weights,
           gpu.fp8_rms_norm_scaled_mm, gpu.fp8_silu_and_mul_scaled_mm),
    Kernel("triton_scaled_gemm", gpu.triton_scaled_gemm_supports, gpu.triton_scaled_gemm),
    Kernel("int_mm", _int_mm_supports, int_mm),
    Kernel("dequant_matmul", lambda scheme, device: True, dequant_matmul),
]


def select_kernel(scheme: W8A8Scheme, device: torch.device) -> Kernel:
    """The first kernel of :data:`KERNELS` that runs ``scheme`` on ``device``."""
    return next(kernel for kernel in KERNELS if kernel.supports(scheme, device))
