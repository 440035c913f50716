"""Weight-only 4/8-bit layers on the CPU, their weights kept packed in memory.

- :func:`int4pack_mm`: torch's int4 tiles (``_weight_int4pack_mm_for_cpu``) for 4-bit groups
  of 32 .. 256 rows, outputs a multiple of 16, 16-bit activations (its float32 kernel is
  tens of times slower than a dense float32 matmul, so float32 layers take the next path);
- :func:`int8pack_mm`: torch's int8 rows (``_weight_int8pack_mm``) for 8-bit per-channel
  weights, an asymmetric zero point folded into a per-column correction;
- :func:`sliced_matmul`: everything else; the codes are dequantized :data:`CHUNK_ROWS` input
  rows at a time inside the matmul. 4-bit codes are stored as ``nibbles`` uint8 [in / 2,
  out], byte ``r`` holding row ``r`` (low nibble) and row ``r + in / 2`` (high nibble), so a
  slice unpacks with one mask or shift and no reordering copy; 8-bit codes as uint8 [in, out].

:func:`dequantize_codes` turns unsigned codes into real weights with the layer's scales and
zero points; :mod:`runtime_quant.wna16_kernels` builds its reference on it.
"""

from __future__ import annotations

import torch

from runtime_quant.packing import unpack

CHUNK_ROWS = 1024  # input rows dequantized at a time by the sliced path
INT4PACK_GROUPS = (32, 64, 128, 256)


def _param(layer: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False))


def dequantize_codes(layer: torch.nn.Module, codes: torch.Tensor, row0: int, dtype=torch.float32) -> torch.Tensor:
    """Unsigned codes of input rows ``row0 ..`` [rows, out] -> real weights in ``dtype``."""
    rows, per_group = codes.shape[0], layer.quant_group_rows
    g0, g1 = row0 // per_group, (row0 + rows - 1) // per_group + 1
    zeros, scales = layer.zeros[g0:g1].to(dtype), layer.scales[g0:g1].to(dtype)
    if row0 % per_group == 0 and rows % per_group == 0:  # whole groups: broadcast each group's scales
        grouped = codes.to(dtype).view(g1 - g0, per_group, -1)
        return ((grouped - zeros[:, None]) * scales[:, None]).view(rows, -1)
    group = torch.arange(row0, row0 + rows, device=codes.device) // per_group - g0
    return (codes.to(dtype) - zeros.index_select(0, group)) * scales.index_select(0, group)


def finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(dtype)


# ------------------------------------------------------------ sliced dequantize-and-matmul
def sliced_prepare(layer: torch.nn.Module) -> None:
    codes = unpack(layer.qweight.data, layer.quant_bits, dim=0)  # [in, out] uint8
    del layer.qweight
    if layer.quant_bits == 8:
        _param(layer, "codes", codes)
        return
    half = layer.in_features // 2
    _param(layer, "nibbles", (codes[:half] | (codes[half:] << 4)).contiguous())


def _code_slices(layer: torch.nn.Module):
    """``(first row, codes [rows, out] uint8)`` for consecutive slices of about CHUNK_ROWS rows."""
    if hasattr(layer, "codes"):
        for start in range(0, layer.in_features, CHUNK_ROWS):
            yield start, layer.codes[start : start + CHUNK_ROWS]
        return
    half = layer.in_features // 2
    for start in range(0, half, CHUNK_ROWS // 2):
        stop = min(start + CHUNK_ROWS // 2, half)
        yield start, layer.nibbles[start:stop] & 15
        yield half + start, layer.nibbles[start:stop] >> 4


def sliced_matmul(layer: torch.nn.Module, scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize a slice of input rows at a time in ``x``'s dtype; accumulate in float32."""
    acc = None
    for start, codes in _code_slices(layer):
        part = x[:, start : start + codes.shape[0]] @ dequantize_codes(layer, codes, start, x.dtype)
        acc = part.float() if acc is None else acc.add_(part)
    return finish(acc, bias, x.dtype)


# ------------------------------------------------------------ torch's CPU int4 / int8 kernels
def int4pack_supports(scheme, layer: torch.nn.Module) -> bool:
    return (
        layer.qweight.device.type == "cpu"
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and scheme.bits == 4
        and layer.quant_params_dtype in (torch.bfloat16, torch.float16)
        and layer.quant_group_rows in INT4PACK_GROUPS
        and layer.in_features % layer.quant_group_rows == 0
        and layer.qweight.shape[1] % 16 == 0  # torch packs tiles of 16 output columns
    )


def int4pack_prepare(layer: torch.nn.Module) -> None:
    """[in / 8, out] words -> torch's int4 tiles [out, in / 2] and [groups, out, 2] (scale, offset):
    ``w = (q - 8) * scale + offset``, so ``offset = (8 - zero) * scale``."""
    codes = unpack(layer.qweight.data, 4, dim=0).t().to(torch.int32).contiguous()  # [out, in]
    tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = layer.scales.data
    offsets = (8.0 - layer.zeros.data.float()) * scales
    del layer.qweight, layer.zeros, layer.scales  # the tiles replace them: memory stays packed
    _param(layer, "int4_tiles", tiles)
    _param(layer, "scales_and_zeros", torch.stack([scales, offsets], dim=-1).to(layer.quant_params_dtype).contiguous())


def int4pack_mm(layer: torch.nn.Module, scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scales_and_zeros = layer.scales_and_zeros
    if x.dtype != scales_and_zeros.dtype:
        scales_and_zeros = scales_and_zeros.to(x.dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.int4_tiles, layer.quant_group_rows, scales_and_zeros)
    return y if bias is None else y + bias.to(y.dtype)


def int8pack_supports(scheme, layer: torch.nn.Module) -> bool:
    return (
        layer.qweight.device.type == "cpu"
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        and scheme.bits == 8
        and layer.quant_group_rows == layer.in_features
    )


def int8pack_prepare(layer: torch.nn.Module) -> None:
    """Per-channel 8-bit codes -> signed int8 rows [out, in]; an asymmetric zero point becomes
    a per-column correction ``(zero - 128) * scale`` times the row sum of ``x``."""
    codes = unpack(layer.qweight.data, 8, dim=0).t()  # [out, in] uint8
    signed = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    scales = layer.scales.data[0]
    correction = (layer.zeros.data[0].float() - 128.0) * scales  # [out]
    del layer.qweight, layer.zeros, layer.scales
    _param(layer, "int8_rows", signed)
    _param(layer, "row_scales", scales.to(layer.quant_params_dtype))
    _param(layer, "zero_correction", correction if bool(correction.any()) else correction[:0])


def int8pack_mm(layer: torch.nn.Module, scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scales = layer.row_scales if layer.row_scales.dtype == x.dtype else layer.row_scales.to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.int8_rows, scales)
    if layer.zero_correction.numel():
        y = (y.float() - x.float().sum(-1, keepdim=True) * layer.zero_correction).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)
