"""RMSNorm (Llama and Gemma variants), optionally fused with the residual add.

Numerics follow ``runtime.models.layers.RMSNorm`` / ``GemmaRMSNorm``: the mean square
is taken in float32; Llama rounds the normalized value to the activation dtype before
multiplying by the weight, Gemma multiplies by ``1 + weight`` in float32 and rounds once.
"""

from __future__ import annotations

import torch

from runtime_kernels.utils import check_last_dim_contiguous, next_power_of_2, require_triton

MAX_HIDDEN = 65536  # one row per program keeps the whole row in registers


def _launch(x, residual, weight, eps, gemma):
    require_triton("rms_norm")
    from runtime_kernels.jit.norm import rms_norm_kernel

    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is larger than the kernel's maximum {MAX_HIDDEN}")
    x2 = x.reshape(-1, hidden)
    check_last_dim_contiguous("x", x2)
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    block_n = next_power_of_2(hidden)
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), hidden, float(eps),
            HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK_N=block_n,
            num_warps=min(16, max(1, block_n // 256)),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """``x`` [..., hidden] normalized and scaled by ``weight`` [hidden]."""
    return _launch(x, None, weight, eps, gemma)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; inputs are left untouched."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    return _launch(x, residual, weight, eps, gemma)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float, gemma: bool = False):
    summed = x + residual
    return rms_norm_ref(summed, weight, eps, gemma), summed
