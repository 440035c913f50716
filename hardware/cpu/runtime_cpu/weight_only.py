"""Weight-only int8 and int4 on the CPU, quantized on load, for batch-1 decoding.

A one-token decode step reads every weight once, so on a CPU its matmuls are bound by the
bytes of the weights (and their unpacking): int8 halves those of bfloat16, int4 quarters
them. Every linear layer is quantized from the checkpoint's 16/32-bit weight, so any such
checkpoint works, the default GGUF model included (its tensors arrive dequantized). In a
16-bit model the output layer takes int8 rows with either method (as llama.cpp's files keep
it in 8 bits, the default model's Q8_0 included); a tied one gets its own int8 copy of the
embedding, which stays as loaded for the token lookup. A float32 model keeps its output
layer: the kernels' bfloat16 results would coarsen its logits:

- ``int8_weight_only``: int8 rows ``[out, in]``, one symmetric scale per output row
  (``amax / 127``), torch's ``_weight_int8pack_mm``;
- ``int4_weight_only``: 4-bit codes in groups of :data:`INT4_GROUP` inputs, each group's
  scale spanning its minimum to its maximum (llama.cpp's Q4_1 layout, the default model's),
  scales and offsets in bfloat16, torch's ``_weight_int4pack_mm_for_cpu``.

Both kernels compute in bfloat16 (their float32 paths are many times slower than a float32
matmul), so a float32 model's activations pass through bfloat16 in its linear layers.
``benchmarks/RESULTS.md`` has the timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

COMPUTE_DTYPE = torch.bfloat16
INT4_GROUP = 32


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> int8 rows [out, in] and their scales [out] in :data:`COMPUTE_DTYPE`.

    A row's scale is its ``amax / 127`` rounded to the compute dtype, and the codes are taken
    against that rounded scale, so quantizing ``rows * scales`` again gives the same codes.
    """
    weight = weight.float()
    scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(COMPUTE_DTYPE)  # [out]
    rows = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return rows.contiguous(), scales


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> codes [out, in] int32 in 0..15 and ``[in / group, out, 2]`` (scale,
    offset) in :data:`COMPUTE_DTYPE`, torch's int4 layout: ``w ~ (code - 8) * scale + offset`` per
    group of :data:`INT4_GROUP` inputs. The scale spans the group (``(max - min) / 15``), and the
    codes are taken against the rounded scale and offset."""
    out, size = weight.shape
    groups = weight.float().view(out, size // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)  # [out, groups]
    scales = ((high - low) / 15).clamp(min=1e-12).to(COMPUTE_DTYPE).float()
    offsets = (low + 8 * scales).to(COMPUTE_DTYPE).float()
    codes = torch.round((groups - offsets[..., None]) / scales[..., None] + 8).clamp(0, 15)
    params = torch.stack([scales.t(), offsets.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
    return codes.view(out, size).to(torch.int32), params


def dequantize_groups(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """What :func:`quantize_groups` stands for: float32 [out, in]."""
    out, size = codes.shape
    scales, offsets = (params[..., i].float().t()[..., None] for i in (0, 1))  # [out, groups, 1]
    return ((codes.float().view(out, size // INT4_GROUP, INT4_GROUP) - 8) * scales + offsets).view(out, size)


class _WeightOnlyMethod:
    """:class:`runtime.quantization.QuantMethod` of one of this module's linear methods."""

    name = ""
    supports_tensor_parallel = True  # each rank quantizes its part of the weights (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> WeightOnlyConfig:
        if quantization_config is not None:
            raise ValueError(
                f"{self.name} quantizes 16/32-bit checkpoints on load; this checkpoint is already "
                f"quantized (quant_method {quantization_config.get('quant_method')!r})"
            )
        head = getattr(model_config, "dtype", torch.float32) in (torch.bfloat16, torch.float16)
        return WeightOnlyConfig(self.name, self.linear, quantize_head=head)


class Int8WeightOnlyMethod(_WeightOnlyMethod):
    name = "int8_weight_only"

    @property
    def linear(self):
        return Int8WeightOnlyLinear()


class Int4WeightOnlyMethod(_WeightOnlyMethod):
    name = "int4_weight_only"

    @property
    def linear(self):
        return Int4WeightOnlyLinear()


@dataclass(frozen=True)
class WeightOnlyConfig:
    """One linear method for every linear layer; int8 rows for the output layer, tied or not,
    where ``quantize_head`` (16-bit models)."""

    name: str
    linear: Any
    quantize_head: bool = False

    def linear_method(self, prefix: str):
        if prefix == "lm_head":
            return self.tied_head_method()
        return self.linear

    def tied_head_method(self):
        return Int8WeightOnlyLinear() if self.quantize_head else None

    def verify_platform(self, platform) -> None:
        if platform.device_type != "cpu":
            raise ValueError(f"{self.name} runs on the cpu platform only, not {platform.name!r}")


class _WeightOnlyLinear:
    """:class:`runtime.quantization.LinearMethod` base: the checkpoint's weight arrives in
    ``weight`` (fused projections stacked) and is packed by ``process_weights_after_loading``."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.quant_output_sizes = list(output_sizes)
        _param(layer, "weight", torch.empty(sum(output_sizes), input_size, dtype=params_dtype))

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "weight":
            raise ValueError("is not part of an unquantized linear layer; a weight-only method expects only 'weight'")
        sizes, shard = layer.quant_output_sizes, shard or 0
        target = layer.weight.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        rank_part = getattr(layer, "rank_part", None)  # runtime's linear layers: this tensor-parallel rank's part
        if rank_part is not None:
            tensor = rank_part(tensor, shard, out_dim=0, in_dim=1)
        if list(tensor.shape) != list(target.shape) or not tensor.dtype.is_floating_point:
            raise ValueError(
                f"has shape {list(tensor.shape)} and dtype {tensor.dtype}, expected a float [{sizes[shard]}, {target.shape[1]}] ([out, in])"
            )
        target.copy_(tensor)


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        rows, scales = quantize_rows(layer.weight.data)
        del layer.weight
        _param(layer, "int8_rows", rows)
        _param(layer, "row_scales", scales)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype
        y = torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE).contiguous(), layer.int8_rows, layer.row_scales)
        return _finish(y, bias, x.dtype)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        out, size = layer.weight.shape
        if size % INT4_GROUP or out % 16:
            raise ValueError(
                f"int4_weight_only needs inputs in groups of {INT4_GROUP} and outputs in tiles of 16, got [{out}, {size}]"
            )
        codes, params = quantize_groups(layer.weight.data)
        del layer.weight
        _param(layer, "int4_tiles", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        _param(layer, "scales_and_zeros", params)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(COMPUTE_DTYPE).contiguous(), layer.int4_tiles, INT4_GROUP, layer.scales_and_zeros
        )
        return _finish(y, bias, x.dtype)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(dtype)
