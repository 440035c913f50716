"""GGUF layers on the GPU: Triton kernels that read llama.cpp's blocks as stored.

Up to :data:`GEMV_MAX_ROWS` rows take the dequantize-in-kernel GEMV (split along K so a small
layer still fills the GPU); larger batches the dequantize-tile + ``tl.dot`` GEMM. Nothing is
dequantized outside the kernels: a Q4_K layer stays at 4.5 bits a weight in memory.
"""

from __future__ import annotations

import os

import torch

from runtime_quant.gguf_blocks import BlockType
from runtime_quant.wna16_gpu import GemvConfig, _cdiv, _num_sms  # the same tiling knobs as the 4/8-bit GEMV

GEMV_MAX_ROWS = 4
# Triton's interpreter turns float32 into bfloat16 wrongly inside a kernel: there the GEMM
# multiplies in float32 (as runtime_quant.wna16_gpu does).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """Tiles of the decode GEMV: enough programs (column blocks x K splits) for ~4 per SM."""
    if device.type != "cuda":
        return GemvConfig(16, 64, min(2, _cdiv(k, 64)))  # the interpreter: small, and exercise the split
    block_n, block_k = 32, 256
    k_blocks = _cdiv(k, block_k)
    wanted = _cdiv(4 * _num_sms(device.index or 0), _cdiv(n, block_n))
    return GemvConfig(block_n, block_k, max(1, min(k_blocks, wanted, 16)))


def gguf_gemv(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x`` [M <= 4, K] @ W.T for raw rows ``qweight`` [N, row bytes] -> ``out`` [M, N] (a view may be given)."""
    from runtime_quant.jit_gguf import gguf_gemv_kernel

    rows, k = x.shape
    n = qweight.shape[0]
    c = config or gemv_config(n, k, x.device)
    block_m = 1 << (rows - 1).bit_length()
    k_per_split = _cdiv(_cdiv(k, c.block_k), c.split) * c.block_k
    split = _cdiv(k, k_per_split)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(split, block_m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    gguf_gemv_kernel[(_cdiv(n, c.block_n), split)](
        x, qweight, bias if bias is not None else out, out, parts,
        rows, n, k, k_per_split, x.stride(0), qweight.stride(0), out.stride(0),
        TYPE=t.ggml, SPLIT_K=split, HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
    )
    if split > 1:
        total = parts[:, :rows].sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


def gguf_gemm(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ W.T through the dequantize-tile + ``tl.dot`` GEMM."""
    from runtime_quant.jit_gguf import gguf_gemm_kernel

    rows, k = x.shape
    n = qweight.shape[0]
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 64 if rows <= 32 else 128
    block_k = 64 if x.device.type == "cuda" else 32
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    gguf_gemm_kernel[(_cdiv(rows, block_m), _cdiv(n, block_n))](
        x, qweight, bias if bias is not None else out, out, rows, n, k,
        x.stride(0), qweight.stride(0), out.stride(0),
        TYPE=t.ggml, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
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
