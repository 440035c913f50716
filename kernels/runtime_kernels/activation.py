"""SiLU-and-mul (the gated MLP activation of Llama, Qwen, Mistral) and its reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime_kernels.utils import cdiv, check_last_dim_contiguous, require_triton

BLOCK = 1024  # output columns per program


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 2 * d] = ``[gate | up]`` -> ``silu(gate) * up`` [..., d]."""
    require_triton("silu_and_mul")
    from runtime_kernels.jit.activation import silu_and_mul_kernel

    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even ([gate | up]), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    check_last_dim_contiguous("x", x2)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        silu_and_mul_kernel[(x2.shape[0], cdiv(d, BLOCK))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=BLOCK)
    return out.view(*x.shape[:-1], d)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
