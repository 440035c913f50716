"""Weight-only 4/8-bit GEMMs; the kernel is chosen per layer by device and shape.

Every layer arrives in one canonical layout (see
:meth:`runtime_quant.wna16_linear.WNA16LinearMethod.process_weights_after_loading`):

- ``qweight`` int32 [in / pack, out]: code ``k`` of column ``n`` in word ``k // pack`` at
  bits ``bits * (k % pack)`` (GPTQ's packing), unsigned;
- ``scales`` float32 [groups, out], ``zeros`` uint8 [groups, out];
- ``layer.quant_group_rows``: input rows per group (the last group may be short).

``w[k, n] = (q[k, n] - zeros[k // rows, n]) * scales[k // rows, n]`` and the layer computes
``x @ w``. A :class:`WNA16Kernel` may repack the layer once (``prepare``) into what it
reads: on the CPU (:mod:`runtime_quant.wna16_cpu`) torch's int4 tiles or int8 rows, else
codes dequantized a slice of rows at a time inside the matmul; on a GPU, Triton kernels
(:mod:`runtime_quant.wna16_gpu`). :func:`dequant_matmul` is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime_quant import wna16_cpu, wna16_gpu
from runtime_quant.packing import unpack
from runtime_quant.wna16_cpu import dequantize_codes, finish
from runtime_quant.wna16_scheme import WNA16Scheme


def dequant_matmul(layer: torch.nn.Module, scheme: WNA16Scheme, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: the whole weight dequantized to float32, then ``x @ w``."""
    codes = unpack(layer.qweight, scheme.bits, dim=0)[: layer.in_features]
    return finish(x.float() @ dequantize_codes(layer, codes, 0), bias, x.dtype)


@dataclass(frozen=True)
class WNA16Kernel:
    name: str
    supports: Callable[[WNA16Scheme, torch.nn.Module], bool]
    run: Callable[[torch.nn.Module, WNA16Scheme, torch.Tensor, torch.Tensor | None], torch.Tensor]
    prepare: Callable[[torch.nn.Module], None] = lambda layer: None


def _on_cpu(scheme: WNA16Scheme, layer: torch.nn.Module) -> bool:
    return layer.qweight.device.type == "cpu"


KERNELS: list[WNA16Kernel] = [
    WNA16Kernel("triton_wna16", wna16_gpu.supports, wna16_gpu.triton_wna16),
    WNA16Kernel("int4pack_mm", wna16_cpu.int4pack_supports, wna16_cpu.int4pack_mm, wna16_cpu.int4pack_prepare),
    WNA16Kernel("int8pack_mm", wna16_cpu.int8pack_supports, wna16_cpu.int8pack_mm, wna16_cpu.int8pack_prepare),
    WNA16Kernel("sliced_matmul", _on_cpu, wna16_cpu.sliced_matmul, wna16_cpu.sliced_prepare),
    WNA16Kernel("dequant_matmul", lambda scheme, layer: True, dequant_matmul),
]


@dataclass(frozen=True)
class BoundKernel:
    """A kernel bound to its scheme: ``run(layer, x, bias)``, as the linear method calls it."""

    kernel: WNA16Kernel
    scheme: WNA16Scheme

    @property
    def name(self) -> str:
        return self.kernel.name

    def prepare(self, layer: torch.nn.Module) -> None:
        self.kernel.prepare(layer)

    def run(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.run(layer, self.scheme, x, bias)


def select_wna16_kernel(scheme: WNA16Scheme, layer: torch.nn.Module) -> BoundKernel:
    """The first kernel of :data:`KERNELS` that runs ``scheme`` for ``layer`` (canonical layout)."""
    return BoundKernel(next(k for k in KERNELS if k.supports(scheme, layer)), scheme)
