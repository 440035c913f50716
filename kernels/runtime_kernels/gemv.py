"""Matrix-vector product for batch-1 decode steps, and its reference.

``gemv(x, weight, bias)`` computes ``F.linear(x, weight, bias)`` for ``x`` of one row
(``[1, K]`` or ``[K]``), accumulating in float32. A decode step of one sequence reads
every weight once and does little arithmetic, so its speed is the rate at which the
weights stream from memory; cuBLAS's general kernels leave some of that on the table for
a single row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime_kernels.utils import cdiv, check_last_dim_contiguous, interpreting, require_triton

INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K = 4, 64


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [1, K] or [K], ``weight`` [N, K], ``bias`` [N] -> ``x @ weight.T + bias`` shaped like ``x``'s rows.

    ``scale`` (float32 [N]): ``weight`` holds 8-bit codes (FP8) whose row ``i`` is worth
    ``weight[i] * scale[i]``; the product is the dequantized weight's, ``x`` not quantized.
    """
    require_triton("gemv")
    from runtime_kernels.jit.gemv import gemv_8bit_kernel_tuned, gemv_kernel, gemv_kernel_tuned

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got {rows.shape[0]}; use F.linear for batches")
    n, k = weight.shape
    if rows.shape[1] != k:
        raise ValueError(f"x has {rows.shape[1]} features but weight expects {k}")
    if scale is not None and scale.shape != (n,):
        raise ValueError(f"scale must be one float32 per weight row, shape ({n},), got {tuple(scale.shape)}")
    check_last_dim_contiguous("weight", weight)
    vec = rows[0].contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    has_bias, has_scale = bias is not None, scale is not None
    args = (vec, weight, scale if has_scale else out, bias if has_bias else out, out, n, k, weight.stride(0))
    if interpreting():
        grid = (cdiv(n, INTERPRETER_BLOCK_N),)
        gemv_kernel[grid](*args, HAS_SCALE=has_scale, HAS_BIAS=has_bias, BLOCK_N=INTERPRETER_BLOCK_N, BLOCK_K=INTERPRETER_BLOCK_K)
    else:
        tuned = gemv_8bit_kernel_tuned if weight.element_size() == 1 else gemv_kernel_tuned
        tuned[lambda meta: (cdiv(n, meta["BLOCK_N"]),)](*args, HAS_SCALE=has_scale, HAS_BIAS=has_bias)
    return out.view(*x.shape[:-1], n)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
