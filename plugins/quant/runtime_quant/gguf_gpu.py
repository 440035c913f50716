"""GGUF layers on the GPU: Triton kernels that read llama.cpp's blocks as stored.

Up to :data:`GEMV_MAX_ROWS` rows take the dequantize-in-kernel GEMV (split along K so a small
layer still fills the GPU); larger batches the fused dequantize-tile + ``tl.dot`` GEMM
(:mod:`runtime_quant.jit_gguf`), and from :data:`DEQUANT_MIN_ROWS` rows the layer dequantized into
a reused scratch of ONE layer (the largest layer's weights in the activations' dtype, shared by
all layers: never a copy of the model) and multiplied by cuBLAS: at hundreds of rows writing and
reading 2 bytes a weight costs less than a fused GEMM whose dequantized tile must fit in registers.
The layer's raw rows stay the only lasting copy, so a Q4_K layer stays at 4.5 bits a weight in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from runtime_quant.gguf_blocks import BlockType
from runtime.envs import env_int
from runtime_quant.wna16_gpu import GemvConfig, _cdiv, _locks, _num_sms  # the 4/8-bit GEMV's knobs and counters
from runtime_quant.wna16_gpu import scratch as _scratch  # one layer's dequantized weights, shared with the 4/8-bit layers

GEMV_MAX_ROWS = 4
# From this many rows the layer is dequantized into a scratch of one layer (not a copy of the model:
# the largest layer's weights in the activations' dtype, reused by every layer) and multiplied by
# cuBLAS, instead of the fused GEMM. Provisional: to be set from ``plugins/quant/bench/gguf_gpu.py``
# (its table compares both paths at 16 and 256 rows); RUNTIME_GGUF_DEQUANT_MIN_ROWS overrides.
DEQUANT_MIN_ROWS = env_int("RUNTIME_GGUF_DEQUANT_MIN_ROWS", 128, 1)
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


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # a power of two, a multiple of the type's unit (Q6_K: of 128)
    split: int = 1  # programs along K (only where one row block covers ``x``)
    num_warps: int = 4
    num_stages: int = 3


def gemm_config(t: BlockType, rows: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Tiles of the fused GEMM, 8 warps. The dequantized weight tile lives in registers (several a
    weight: byte pointers, codes, scales), so the tiles are the largest that compile for sm_90 without
    spills for every type (Triton 3.9, cuobjdump of the cubin, no GPU): 16 rows x 64 columns x 64
    inputs up to 16 rows (70-245 registers), 64 x 64 x 64 up to 64, then 128 x 64 x 64 (242-255);
    Q6_K takes 128 inputs a step (4 units, a super-block half): 16 x 64, then 64 x 32 and 128 x 32.
    One row block that gives fewer than ~2 programs per SM is split along K (at most 8 ways, at least
    4 steps a split). Provisional: ``plugins/quant/bench/gguf_gpu.py --sweep-gemm`` times alternatives."""
    q6 = t.name == "Q6_K"
    block_k = 128 if q6 else 64
    if device.type != "cuda":  # the interpreter: small tiles, a split when one row block covers x
        block_m = 16 if rows <= 16 else 32
        return GemmConfig(block_m, 16, 128, 2 if rows <= block_m else 1)
    block_m = 16 if rows <= 16 else (64 if rows <= 64 else 128)
    block_n = 32 if q6 and rows > 16 else 64
    split = 1
    if rows <= block_m:
        split = max(1, min(_cdiv(2 * _num_sms(device.index or 0), _cdiv(n, block_n)), _cdiv(k, 4 * block_k), 8))
    return GemmConfig(block_m, block_n, block_k, split, num_warps=8)


def _check_block_k(t: BlockType, block_k: int) -> int:
    unit = unit_inputs(t)
    if block_k % unit or block_k & (block_k - 1) or (t.name == "Q6_K" and block_k % 128):
        raise ValueError(f"GEMM block_k {block_k} must be a power of two and a multiple of {t.name}'s "
                         f"{128 if t.name == 'Q6_K' else unit} inputs")
    return block_k // unit


def gguf_gemm(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """``x`` [M, K] @ W.T through the fused GEMM: per K step one weight tile dequantized in registers
    and one ``tl.dot`` against the contiguous ``x`` tile."""
    from runtime_quant.jit_gguf import gguf_gemm_kernel

    rows, k = x.shape
    n = qweight.shape[0]
    c = config or gemm_config(t, rows, n, k, x.device)
    step = _check_block_k(t, c.block_k)
    m_blocks = _cdiv(rows, c.block_m)
    num_units = k // unit_inputs(t)
    split = c.split if m_blocks == 1 else 1
    units_per_split = _cdiv(_cdiv(num_units, step), split) * step
    split = _cdiv(num_units, units_per_split)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(split, c.block_m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    gguf_gemm_kernel[(_cdiv(n, c.block_n), split, m_blocks)](
        x, qweight, _words(qweight), bias if bias is not None else out, out, parts, _locks(x.device),
        rows, n, k, units_per_split, split, x.stride(0), qweight.stride(0), out.stride(0),
        TYPE=t.ggml, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, A=step, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out


def gguf_dequantize_gpu(qweight: torch.Tensor, t: BlockType, dtype: torch.dtype, out: torch.Tensor | None = None,
                        block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """The layer's weights [N, K] in ``dtype`` (gguf-py's values), into ``out`` or the one-layer scratch."""
    from runtime_quant.jit_gguf import gguf_dequantize_kernel

    n = qweight.shape[0]
    k = qweight.shape[1] // t.nbytes * t.block
    step = _check_block_k(t, block_k)
    if out is None:
        out = _scratch(n * k, dtype, qweight.device).view(n, k)
    gguf_dequantize_kernel[(_cdiv(n, block_n), _cdiv(k, block_k))](
        qweight, _words(qweight), out, n, k, qweight.stride(0), out.stride(0),
        TYPE=t.ggml, BLOCK_N=block_n, A=step, num_warps=4,
    )
    return out


def gguf_dequant_mm(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ W.T for large batches: the layer dequantized into the one-layer scratch (2 bytes a
    weight written and read back), then cuBLAS."""
    w = gguf_dequantize_gpu(qweight, t, x.dtype)
    if out is None:
        return torch.nn.functional.linear(x, w, bias)
    if bias is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(bias.to(x.dtype), x, w.t(), out=out)


def gguf_matmul(qweight: torch.Tensor, t: BlockType, x: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] -> [M, N]: the GEMV for up to :data:`GEMV_MAX_ROWS` rows, else the GEMM."""
    x = x.contiguous()
    if x.shape[0] == 0:
        return out if out is not None else torch.empty(0, qweight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gguf_gemv(qweight, t, x, bias, out)
    if x.shape[0] >= DEQUANT_MIN_ROWS:
        return gguf_dequant_mm(qweight, t, x, bias, out)
    return gguf_gemm(qweight, t, x, bias, out)
