"""``gguf``: a GGUF file's quantized linear weights kept in llama.cpp's blocks (``--quantization gguf``).

Without the flag a GGUF file is dequantized at load (core's default), except where the packed
path is the faster one: a bfloat16 model on a CPU with AVX-512 BF16 whose linear weights are all
Q4_0 / Q4_1 / Q4_K loads packed (:meth:`GgufMethod.packs_gguf_by_default`; the engine logs it, and
``RUNTIME_GGUF_DEQUANTIZE=1`` dequantizes instead). With the flag, every linear
layer receives its projections' raw blocks from the loader (``qweight_type`` then ``qweight``
per projection; see :mod:`runtime.model_loader.gguf_weights`) and keeps them packed:
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K (:data:`runtime_quant.gguf_blocks.BLOCK_TYPES`).
The projections of a fused layer (qkv, gate_up) may have different types (Q4_K_M files mix
Q5_0, Q8_0, Q4_K and Q6_K): consecutive projections of one type form one *part*, computed by
one kernel into its columns of the output.

At tensor parallel each rank keeps its rows of column-parallel layers and whole blocks of inputs of
row-parallel ones (a layer whose inputs per rank are not a multiple of the block is refused).

Embeddings and norms stay dequantized, as without the flag. A linear weight of another ggml
type (Q2_K, Q3_K, IQ*, Q5_1 ...) or an unquantized one (F32, F16, BF16) is dequantized at
load into its part (the loader logs each quantized one by name) and the model runs.

Kernels: on a GPU, Triton kernels that read the blocks as stored (:mod:`runtime_quant.gguf_gpu`);
on the CPU, Q4_0 / Q4_1 / Q4_K in 16-bit models stay at 4 bits (an AVX-512 BF16 kernel for
bf16, else torch's int4 tiles), other types are dequantized a slice at a time
(:mod:`runtime_quant.gguf_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime_quant.gguf_blocks import BF16, BLOCK_TYPES, F16, F32, BlockType
from runtime_quant.gguf_cpu import INT4_TYPES, cpu_part
from runtime_quant.gguf_cpu_panels import PANEL, cpu_has_avx512_bf16

UNQUANTIZED = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}


def _type_name(ggml: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml).name
    except (ImportError, ValueError):
        return f"#{ggml}"


SUPPORTED = ", ".join(t.name for t in BLOCK_TYPES.values())


class TritonPart:
    """A run of output rows as raw blocks on a GPU, multiplied by the Triton kernels."""

    def __init__(self, raw: torch.Tensor, t: BlockType):
        self.raw, self.type = raw.contiguous(), t

    def params(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.raw}

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from runtime_quant.gguf_gpu import gguf_matmul

        gguf_matmul(self.raw, self.type, x, None, out)


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


@dataclass(frozen=True)
class GgufLinearMethod:
    """:class:`runtime.quantization.LinearMethod` of a layer holding GGUF blocks (stateless)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.quant_output_sizes = list(output_sizes)
        layer.quant_params_dtype = params_dtype
        layer.gguf_types = [None] * len(output_sizes)  # per projection: ggml type id
        layer.gguf_data = [None] * len(output_sizes)  # per projection: raw rows (or a float weight)
        # Stand-ins the loader counts as loaded once every projection delivered them.
        _param(layer, "qweight", torch.empty(0, dtype=torch.uint8))
        _param(layer, "qweight_type", torch.empty(len(output_sizes), dtype=torch.int64))

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        shard = shard or 0
        rows, size = layer.quant_output_sizes[shard], layer.in_features
        if name == "qweight_type":
            ggml = int(tensor)
            if ggml not in BLOCK_TYPES and ggml not in UNQUANTIZED:
                raise ValueError(f"has ggml type {_type_name(ggml)}, which --quantization gguf does not run; supported: "
                                 f"{SUPPORTED} (and F32, F16, BF16)")
            layer.gguf_types[shard] = ggml
            return
        if name != "qweight":
            raise ValueError("is not part of a GGUF layer; expected qweight_type and qweight (raw blocks)")
        ggml = layer.gguf_types[shard]
        if ggml is None:
            raise ValueError("arrived before its qweight_type")
        t = BLOCK_TYPES.get(ggml)
        tensor = _rank_part(layer, tensor, shard, t)
        if t is None:
            expected, ok = f"{_type_name(ggml)} [{rows}, {size}]", tensor.dtype == UNQUANTIZED[ggml]
            shape = [rows, size]
        else:
            if size % t.block:
                raise ValueError(f"is {t.name}, whose blocks of {t.block} inputs do not divide the layer's {size} inputs")
            shape = [rows, t.row_bytes(size)]
            expected, ok = f"{t.name} uint8 {shape} ([out, {size // t.block} blocks x {t.nbytes} bytes])", tensor.dtype == torch.uint8
        if list(tensor.shape) != shape or not ok:
            raise ValueError(f"has shape {list(tensor.shape)} and dtype {str(tensor.dtype).removeprefix('torch.')}, expected {expected}")
        layer.gguf_data[shard] = tensor

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Group consecutive projections of one type into parts; give each its kernel's form."""
        device = layer.qweight.device
        dtype = layer.quant_params_dtype
        types, data = layer.gguf_types, layer.gguf_data
        if any(d is None for d in data):
            raise ValueError("--quantization gguf keeps a GGUF file's blocks, but a linear layer received none "
                             "(--load-format dummy makes random weights, not blocks: leave --quantization unset for it)")
        del layer.qweight, layer.qweight_type, layer.gguf_types, layer.gguf_data
        parts, offsets = [], []
        start = 0
        for i in range(len(types) + 1):
            if i < len(types) and (i == start or _key(types[i]) == _key(types[start])):
                continue
            raw = torch.cat(data[start:i]) if i - start > 1 else data[start]
            t = BLOCK_TYPES.get(types[start])
            offsets.append((sum(layer.quant_output_sizes[:start]), sum(layer.quant_output_sizes[start:i])))
            parts.append(_make_part(raw.to(device), t, dtype, device))
            start = i
        for index, part in enumerate(parts):
            for name, tensor in part.params().items():
                _param(layer, f"part{index}_{name}", tensor)
        layer.gguf_parts = parts
        layer.gguf_columns = offsets  # per part: (first output column, columns)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype
        out = torch.empty(x.shape[0], sum(layer.quant_output_sizes), dtype=x.dtype, device=x.device)
        for part, (offset, width) in zip(layer.gguf_parts, layer.gguf_columns):
            part.matmul(x, out if width == out.shape[1] else out[:, offset : offset + width])
        return out if bias is None else out.add_(bias.to(out.dtype))


def _rank_part(layer: nn.Module, tensor: torch.Tensor, shard: int, t: BlockType | None) -> torch.Tensor:
    """This tensor-parallel rank's rows (column-parallel layers) or whole blocks of inputs (row-parallel
    ones) of a projection's raw rows [out, bytes] (or dense weight [out, in])."""
    if t is None or tensor.dim() != 2 or tensor.dtype != torch.uint8 or tensor.shape[1] % t.nbytes:
        return layer.rank_part(tensor, shard, out_dim=0, in_dim=1)
    blocks = tensor.view(tensor.shape[0], tensor.shape[1] // t.nbytes, t.nbytes)  # [out, blocks, bytes a block]
    part = layer.rank_part(blocks, shard, out_dim=0, in_dim=1, in_unit=t.block)
    return part.reshape(part.shape[0], -1)


def _key(ggml: int) -> int:
    return ggml if ggml in BLOCK_TYPES else F32  # dense projections join one dense part


def _make_part(raw: torch.Tensor, t: BlockType | None, dtype: torch.dtype, device: torch.device):
    if device.type == "cpu":
        return cpu_part(raw, t, dtype)
    if t is None:
        return cpu_part(raw, None, dtype)  # a dense weight: torch.matmul on any device
    return TritonPart(raw, t)


@dataclass(frozen=True)
class GgufConfig:
    """Every linear layer of a GGUF checkpoint keeps its blocks (a tied head keeps the embedding)."""

    gguf_packed_types: frozenset[int] = frozenset(BLOCK_TYPES)

    def linear_method(self, prefix: str) -> GgufLinearMethod:
        return GgufLinearMethod()


def packed_linear_types(gguf_file: str) -> set[str] | None:
    """The ggml type names of a GGUF file's linear weights (its 2-D tensors but the token
    embedding), or None when one of them has a dimension that is not a multiple of 32."""
    from runtime.model_loader.gguf_reader import gguf_reader  # parsed once per process (the loaders share it)

    types = set()
    for tensor in gguf_reader(gguf_file).tensors:
        if len(tensor.shape) != 2 or tensor.name == "token_embd.weight":
            continue
        if any(int(d) % PANEL for d in tensor.shape):
            return None
        types.add(tensor.tensor_type.name)
    return types


class GgufMethod:
    """:class:`runtime.quantization.QuantMethod` ``gguf``."""

    supports_tensor_parallel = True  # rows, or whole blocks of inputs, per rank (_rank_part)

    def packs_gguf_by_default(self, gguf_file: str, dtype: torch.dtype, platform, tensor_parallel_size: int,
                              pipeline_parallel_size: int) -> str | None:
        """Why ``gguf_file`` loads packed without ``--quantization`` (None: it is dequantized at
        load): a bfloat16 model on a CPU with AVX-512 BF16, one rank, every linear weight of a
        type the panel kernel reads. There it is faster than the dequantized bf16 weights at batch
        1 and as fast in offline batches (benchmarks/RESULTS.md, issue 18), at under half the memory."""
        if getattr(platform, "device_type", None) != "cpu" or dtype != torch.bfloat16:
            return None
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1 or not cpu_has_avx512_bf16():
            return None
        types = packed_linear_types(gguf_file)
        if not types or not types <= set(INT4_TYPES):
            return None
        return f"its linear layers are {'/'.join(sorted(types))}, which this CPU's AVX-512 BF16 kernel reads as they are"

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> GgufConfig:
        if quantization_config is not None:
            raise ValueError(
                f"--quantization gguf reads GGUF files; this checkpoint is quantized with "
                f"{quantization_config.get('quant_method')!r}"
            )
        if not getattr(model_config, "gguf_file", None):
            raise ValueError(
                f"--quantization gguf keeps a GGUF file's blocks packed, but {getattr(model_config, 'model', '?')!r} "
                "is not a GGUF checkpoint (pass a .gguf file, or leave --quantization unset)"
            )
        return GgufConfig()
