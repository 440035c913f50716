"""The linear method of every 8-bit scheme: create, load, repack and compute one layer.

Parameters are named as in the checkpoints, so the loader can check that each arrived.
Before :meth:`W8A8LinearMethod.process_weights_after_loading` they hold the checkpoint's
layout, fused projections stacked (``weight_scale`` of a per-tensor q/k/v layer is [3], one
scale per projection); afterwards the canonical layout of :mod:`runtime_quant.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime_quant.kernels import quantize, row_scales, select_kernel
from runtime_quant.scheme import FP8, W8A8Scheme

ZERO_POINTS = ("weight_zero_point", "input_zero_point")  # symmetric schemes only: all zeros


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


@dataclass(frozen=True)
class W8A8LinearMethod:
    """:class:`runtime.quantization.LinearMethod` for one :class:`W8A8Scheme` (stateless:
    a layer's tensors, shard sizes and kernel live on the layer)."""

    scheme: W8A8Scheme

    # ------------------------------------------------------------ create
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        s = self.scheme
        layer.quant_output_sizes = list(output_sizes)
        rows, shards = sum(output_sizes), len(output_sizes)
        _param(layer, "weight", torch.empty(rows, input_size, dtype=params_dtype if s.online else s.weight_dtype))
        if s.online:
            return
        if s.weight_strategy == "tensor":
            scale = torch.empty(shards, dtype=torch.float32)
        elif s.weight_strategy == "channel":
            scale = torch.empty(rows, 1, dtype=torch.float32)
        else:
            block_rows, block_cols = s.block_size
            scale = torch.empty(sum(_cdiv(n, block_rows) for n in output_sizes), _cdiv(input_size, block_cols))
        _param(layer, s.weight_scale_name, scale.float())
        if s.static_activations:
            _param(layer, "input_scale", torch.empty(shards, dtype=torch.float32))

    # ------------------------------------------------------------ load
    def _rows(self, layer: nn.Module, shard: int, block_rows: int = 1) -> tuple[int, int]:
        """(offset, count) of a projection's rows (or row blocks) in the stacked parameter."""
        sizes = [_cdiv(n, block_rows) for n in layer.quant_output_sizes]
        return sum(sizes[:shard]), sizes[shard]

    def _target(self, layer: nn.Module, name: str, shard: int) -> tuple[torch.Tensor, str]:
        """The slice of parameter ``name`` a projection's tensor fills, and its expected layout."""
        s = self.scheme
        param = getattr(layer, name)
        if name == "weight":
            offset, rows = self._rows(layer, shard)
            dtype = "a 16/32-bit float" if s.online else _dtype(s.weight_dtype)
            return param.narrow(0, offset, rows), f"{dtype} [{rows}, {param.shape[1]}] ([out, in])"
        if name == "input_scale" or s.weight_strategy == "tensor":
            return param.narrow(0, shard, 1), "float32 [] or [1] (one scale per tensor)"
        if s.weight_strategy == "channel":
            offset, rows = self._rows(layer, shard)
            return param.narrow(0, offset, rows), f"float32 [{rows}, 1] (one scale per output channel)"
        offset, blocks = self._rows(layer, shard, s.block_size[0])
        return (
            param.narrow(0, offset, blocks),
            f"float32 [{blocks}, {param.shape[1]}] (one scale per {s.block_size[0]}x{s.block_size[1]} block)",
        )

    def _split_dims(self, name: str, tensor: torch.Tensor) -> tuple[int | None, int, int | None, int]:
        """``(out_dim, out_unit, in_dim, in_unit)`` of a checkpoint tensor, for tensor parallelism."""
        s = self.scheme
        if name == "weight":
            return 0, 1, 1, 1
        if name == "input_scale" or s.weight_strategy == "tensor" or tensor.dim() == 0:
            return None, 1, None, 1  # one scale: every rank takes it whole
        if s.weight_strategy == "channel":
            return 0, 1, None, 1
        return 0, s.block_size[0], 1, s.block_size[1]

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        s = self.scheme
        shard = 0 if shard is None else shard
        if name in ZERO_POINTS:
            if torch.count_nonzero(tensor.float()) > 0:
                raise ValueError(f"is non-zero: asymmetric (zero-point) quantization is not supported; {s.describe}")
            return
        if name == "input_scale" and not s.static_activations:
            return  # dynamic activations ignore a calibrated scale (as vLLM does)
        expected = ("weight",) if s.online else ("weight", s.weight_scale_name) + (("input_scale",) if s.static_activations else ())
        if name not in expected:
            raise ValueError(f"is not part of {s.describe}; expected: {', '.join(expected)}")
        target, layout = self._target(layer, name, shard)
        if tensor.dim() != 2 and (name == "weight" or (name != "input_scale" and s.weight_strategy == "block")):
            # a matrix flattened (or stacked) into another rank holds its values in another order: refused,
            # never reshaped into place
            raise ValueError(f"has shape {_shape(tensor)}, expected {layout}")
        tensor = layer.rank_part(tensor, shard, *self._split_dims(name, tensor))
        if tensor.numel() != target.numel() or (tensor.dim() == 2 and _shape(tensor) != _shape(target)):
            raise ValueError(f"has shape {_shape(tensor)}, expected {layout}")
        if name == "weight" and (tensor.dtype != target.dtype if not s.online else tensor.element_size() < 2):
            raise ValueError(f"has dtype {_dtype(tensor.dtype)}, expected {layout}")
        if name != "weight" and not tensor.dtype.is_floating_point:
            raise ValueError(f"has dtype {_dtype(tensor.dtype)}, expected {layout}")
        target.copy_(tensor.reshape(target.shape))

    # ------------------------------------------------------------ repack
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Bring the layer to the canonical layout of :mod:`runtime_quant.kernels`, pick its kernel."""
        s = self.scheme
        sizes = layer.quant_output_sizes
        if s.online:
            scale = row_scales(layer.weight.data, s.weight_dtype)  # [out, 1]
            _param(layer, "weight", quantize(layer.weight.data, scale, s.weight_dtype))
            weight_scale = scale[:, 0]
        elif s.weight_strategy == "tensor":
            counts = torch.tensor(sizes, device=layer.weight.device)
            weight_scale = getattr(layer, s.weight_scale_name).data.repeat_interleave(counts)  # [out]
        elif s.weight_strategy == "channel":
            weight_scale = getattr(layer, s.weight_scale_name).data[:, 0]
        else:
            weight_scale = self._row_block_scales(layer)
        if s.weight_scale_name != "weight_scale":
            delattr(layer, s.weight_scale_name)
        _param(layer, "weight_scale", weight_scale.float().contiguous())
        if s.static_activations:
            # One input feeds every fused projection: quantize it with the largest scale (as vLLM).
            _param(layer, "input_scale", layer.input_scale.data.max())
        layer.quant_kernel = select_kernel(s, layer.weight.device)

    def _row_block_scales(self, layer: nn.Module) -> torch.Tensor:
        """Block scales [sum of row blocks, col blocks] -> each row's [out, col blocks]."""
        block_rows = self.scheme.block_size[0]
        stacked = getattr(layer, self.scheme.weight_scale_name).data
        parts = []
        for shard, rows in enumerate(layer.quant_output_sizes):
            offset, blocks = self._rows(layer, shard, block_rows)
            parts.append(stacked[offset : offset + blocks].repeat_interleave(block_rows, dim=0)[:rows])
        return torch.cat(parts)

    # ------------------------------------------------------------ compute
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out] in x's dtype
        return layer.quant_kernel.run(layer, self.scheme, x, bias)

    # The op before the layer fused with its activations' quantization (runtime.quantization.LinearMethod):
    # FP8 per-token layers of 2+ rows on a GPU (fp8_scaled_mm); None elsewhere (the ops run apart).
    def apply_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, gemma: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        fused = layer.quant_kernel.after_rms_norm
        return None if fused is None else fused(layer, self.scheme, x, residual, norm_weight, eps, gemma, bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        fused = layer.quant_kernel.after_silu_and_mul
        return None if fused is None else fused(layer, self.scheme, x, bias)

    def gemv_weights(self, layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 codes and row scales where :meth:`apply` of one row of ``dtype`` is runtime-kernels'
        gemv (the ``fp8_scaled_mm`` kernel's batch-1 path), so a norm or activation before the layer
        may fuse into it (``runtime.models.linear.Linear.gemv_operands``); None for every other kernel."""
        gemv_weights = layer.quant_kernel.gemv_weights
        return None if gemv_weights is None else gemv_weights(layer, dtype)


def fp8_online_scheme() -> W8A8Scheme:
    """``--quantization fp8`` of a 16/32-bit checkpoint: per-channel weights, per-token activations."""
    return W8A8Scheme(FP8, "channel", activations="token", online=True)
