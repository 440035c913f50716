"""GGUF layers on the CPU, their weights kept packed in memory.

- :class:`Int4Part`: Q4_0, Q4_1 and Q4_K (4-bit codes, one scale and offset per 32 inputs) in
  a 16-bit model keep their codes at 4 bits, with a 16-bit scale and offset per 32 inputs:
  - bfloat16 on a CPU with AVX-512 BF16: panels of 32 output columns for the kernel of
    :mod:`runtime_quant.gguf_cpu_panels` (faster than a bf16 matmul of the dequantized weights at
    every row count; above 24 rows it multiplies the bf16 path's own weights for Q4_0 / Q4_1);
  - otherwise torch's int4 tiles (``_weight_int4pack_mm_for_cpu``, groups of 32):
    ``w = (q - 8) * s + z`` with ``s`` the block's scale and ``z = offset + s * (8 - zero)``,
    both rounded to the model's dtype. Above :data:`INT4_MAX_ROWS` rows (prefill) the tiles are
    dequantized a slice at a time into the model's dtype and multiplied densely, which torch
    does faster than its int4 kernel there.
  The codes are exact; the scales are exact in float16 for Q4_0 and Q4_1 (``d`` and ``m`` are
  float16), otherwise rounded once (as dequantizing at load rounds every weight).
- :class:`SlicedPart`: every other type, and float32 models: the raw blocks stay as stored and
  are dequantized (gguf-py's float32 values) a few rows at a time into the activations' dtype
  for a dense matmul, at each call.
"""

from __future__ import annotations

import torch

from runtime_quant import gguf_cpu_panels as panels
from runtime_quant.gguf_blocks import BlockType, decode, dequantize

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: smaller elementwise ops are not split over threads
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT4_GROUP = 32
INT4_MAX_ROWS = 256  # more rows than this: dequantize the tiles and multiply densely (measured crossing, 2 threads)
TILE_ROWS = 64  # torch's CPU int4 tiles interleave 64 output rows (see _tile_codes)


def int4_supports(t: BlockType, rows: int, dtype: torch.dtype) -> bool:
    return (
        t.name in INT4_TYPES
        and dtype in (torch.bfloat16, torch.float16)
        and rows % 16 == 0  # torch packs tiles of 16 output rows
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


class Int4Part:
    """A run of output rows at 4 bits: either panels (``codes`` uint8 [rows / 32, in / 32, 16,
    32], ``scales`` and ``zeros`` float16 [in / 32, rows]; see :mod:`runtime_quant.gguf_cpu_panels`)
    or torch's int4 tiles (``tiles`` uint8 [rows, in / 2], ``scales_and_zeros`` [in / 32, rows, 2]
    in the model's dtype)."""

    def __init__(self, raw: torch.Tensor, t: BlockType, dtype: torch.dtype):
        codes, scale, offset = decode(raw, t)  # [rows, in] uint8, [rows, in / 32] float32 x2
        self.rows, self.in_features = raw.shape[0], codes.shape[1]
        offset = offset if offset is not None else torch.zeros_like(scale)
        zero = offset - scale * t.zero  # w = scale * q + zero
        self.is_panels = bool(dtype == torch.bfloat16 and self.rows % panels.PANEL == 0 and panels.available()
                              and torch.isfinite(scale.half()).all() and torch.isfinite(zero.half()).all())
        if self.is_panels:
            self.codes, self.scales, self.zeros = panels.pack(codes, scale, zero)
            return
        self.tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([scale.t(), (zero + 8 * scale).t()], dim=-1).to(dtype).contiguous()

    def params(self) -> dict[str, torch.Tensor]:
        if self.is_panels:
            return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}
        return {"tiles": self.tiles, "scales_and_zeros": self.scales_and_zeros}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.params().values())

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.is_panels:
            out.copy_(panels.panels_mm(x.to(torch.bfloat16), self.codes, self.scales, self.zeros))
            return
        sz = self.scales_and_zeros if x.dtype == self.scales_and_zeros.dtype else self.scales_and_zeros.to(x.dtype)
        if x.shape[0] <= INT4_MAX_ROWS or self.rows % TILE_ROWS:
            out.copy_(torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.tiles, INT4_GROUP, sz))
            return
        w = torch.empty(self.rows, self.in_features, dtype=x.dtype)
        for r0 in range(0, self.rows, TILE_ROWS):  # a tile's ops run inline (see SlicedPart)
            w[r0 : r0 + TILE_ROWS] = self._dequantized(r0, r0 + TILE_ROWS, sz)
        torch.matmul(x, w.t(), out=out)

    def _dequantized(self, r0: int, r1: int, sz: torch.Tensor) -> torch.Tensor:
        """Rows ``r0 .. r1`` (multiples of 64) of the weight [rows, in] in ``sz``'s dtype."""
        k = self.in_features
        tiles = self.tiles[r0:r1].view(-1, k, 32)  # [blocks of 64 rows, in, 32]
        codes = torch.stack([tiles & 15, tiles >> 4], dim=1)  # [blocks, 2, in, 32]: row 64b + 32h + j
        codes = codes.permute(0, 1, 3, 2).reshape(r1 - r0, k // INT4_GROUP, INT4_GROUP)
        scale, zero = sz[:, r0:r1, 0].t()[..., None], sz[:, r0:r1, 1].t()[..., None]  # [rows, groups, 1]
        return ((codes.to(sz.dtype) - 8) * scale + zero).view(r1 - r0, k)


class SlicedPart:
    """A run of output rows kept as llama.cpp's raw blocks, dequantized for each call.

    The rows are dequantized :func:`chunk_rows` at a time, each chunk's tensors under torch's
    parallel grain size so that its dozen small ops run on the calling thread: on this shared
    2-core machine an op handed to OpenMP's two threads waits ~8 ms whenever another job holds a
    core. The whole weight then goes through one (threaded) matmul.
    """

    def __init__(self, raw: torch.Tensor, t: BlockType):
        self.raw, self.type = raw.contiguous(), t

    def params(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.raw}

    def nbytes(self) -> int:
        return self.raw.nbytes

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows, k = self.raw.shape[0], x.shape[1]
        w = torch.empty(rows, k, dtype=x.dtype)
        step = chunk_rows(k)
        for r0 in range(0, rows, step):
            w[r0 : r0 + step] = dequantize(self.raw[r0 : r0 + step], self.type, x.dtype)
        torch.matmul(x, w.t(), out=out)


def chunk_rows(in_features: int) -> int:
    """Rows whose float weights stay under torch's grain size (32768 elements: ops run inline)."""
    return max(1, GRAIN_SIZE // in_features)


class DensePart:
    """Rows that arrived dequantized (an unquantized or unsupported ggml type)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()

    def params(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def nbytes(self) -> int:
        return self.weight.nbytes

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        torch.matmul(x, w.t(), out=out)


def cpu_part(raw: torch.Tensor, t: BlockType | None, dtype: torch.dtype):
    """The CPU form of a run of rows: ``t`` None means ``raw`` is already a float weight."""
    if t is None:
        return DensePart(raw.to(dtype))
    if int4_supports(t, raw.shape[0], dtype):
        return Int4Part(raw, t, dtype)
    return SlicedPart(raw, t)
