"""GGUF layers on the GPU: Triton kernels that read llama.cpp's blocks as stored.

Up to :data:`GEMV_MAX_ROWS` rows take the dequantize-in-kernel GEMV (split along K so a small
layer still fills the GPU); larger batches the dequantize-tile + ``tl.dot`` GEMM
(:mod:`runtime_quant.jit_gguf`). Nothing is dequantized or re-laid outside the kernels: the
layer's raw rows are the only copy, so a Q4_K layer stays at 4.5 bits a weight in memory.
"""

from __future__ import annotations

import os

import torch

from runtime_quant.gguf_blocks import BlockType
from runtime_quant.wna16_gpu import GemvConfig, _cdiv, _locks, _num_sms  # the 4/8-bit GEMV's knobs and counters

GEMV_MAX_ROWS = 4
# Triton's interpreter turns float32 into bfloat16 wrongly inside a kernel: there the GEMM
# multiplies in float32 (as runtime_quant.wna16_gpu does).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unit_inputs(t: BlockType) -> int:
    """Inputs of one kernel unit (see :mod:`runtime_quant.jit_gguf`): a K-quant's 64-input chunk, else 32."""
    return 64 if t.name in ("Q4_K", "Q5_K") else 32


def gemv_config(n: int, k: int, device: torch.device, rows: int = 1) -> GemvConfig:
    """Tiles of the decode GEMV: 32 weight rows (16 for several rows of ``x``: the program keeps a
    float32 sum per weight position and row) by 256 inputs a step, split along K for ~8 programs per SM."""
    if device.type != "cuda":
        return GemvConfig(16, 512, 2)  # the interpreter: small, a partial last step and the split path
    block_n, block_k = (32 if rows == 1 else 16), 256
    wanted = _cdiv(8 * _num_sms(device.index or 0), _cdiv(n, block_n))
    # 8 warps: ~100 registers a thread at 32 x 256 (sm_90 cubin), for more loads in flight per SM
    return GemvConfig(block_n, block_k, max(1, min(_cdiv(k, block_k), wanted, 16)), num_warps=8)


def _words(qweight: torch.Tensor) -> torch.Tensor:
    """The rows as 16-bit words (the same memory): the kernels read float16 fields through it."""
    if qweight.stride(1) != 1 or qweight.shape[1] % 2 or qweight.stride(0) % 2:
        raise ValueError(f"GGUF rows must be contiguous bytes of even length; got shape {list(qweight.shape)}, "
                         f"strides {qweight.stride()}")
    return qweight.view(torch.int16)


def gguf_gemv(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x`` [M <= 4, K] @ W.T for raw rows ``qweight`` [N, row bytes] -> ``out`` [M, N] (a view may be given)."""
    from runtime_quant.jit_gguf import gguf_gemv_kernel

    rows, k = x.shape
    n = qweight.shape[0]
    c = config or gemv_config(n, k, x.device, rows)
    unit = unit_inputs(t)
    if c.block_k % unit or c.block_k & (c.block_k - 1):
        raise ValueError(f"GEMV block_k {c.block_k} must be a power of two and a multiple of {t.name}'s {unit} inputs")
    step = c.block_k // unit  # units per K step
    num_units = k // unit
    units_per_split = _cdiv(_cdiv(num_units, step), c.split) * step
    split = _cdiv(num_units, units_per_split)
    block_m = 1 << (rows - 1).bit_length()
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(split, block_m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    gguf_gemv_kernel[(_cdiv(n, c.block_n), split)](
        x, qweight, _words(qweight), bias if bias is not None else out, out, parts, _locks(x.device),
        rows, n, k, units_per_split, split, x.stride(0), qweight.stride(0), out.stride(0),
        TYPE=t.ggml, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=c.block_n, A=step, num_warps=c.num_warps,
    )
    return out


def gguf_gemm(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ W.T through the dequantize-tile + ``tl.dot`` GEMM (128 inputs a K step)."""
    from runtime_quant.jit_gguf import gguf_gemm_kernel

    rows, k = x.shape
    n = qweight.shape[0]
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else (64 if rows <= 64 else 128))
    block_n = 64 if rows <= 32 else 128
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    gguf_gemm_kernel[(_cdiv(rows, block_m), _cdiv(n, block_n))](
        x, qweight, _words(qweight), bias if bias is not None else out, out, rows, n, k,
        x.stride(0), qweight.stride(0), out.stride(0),
        TYPE=t.ggml, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, A=128 // unit_inputs(t),
        num_warps=8 if block_m * block_n >= 64 * 128 else 4, num_stages=3,
    )
    return out


def gguf_matmul(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] -> [M, N]: the GEMV for up to :data:`GEMV_MAX_ROWS` rows, else the GEMM."""
    x = x.contiguous()
    if x.shape[0] == 0:
        return out if out is not None else torch.empty(0, qweight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gguf_gemv(qweight, t, x, bias, out)
    return gguf_gemm(qweight, t, x, bias, out)
