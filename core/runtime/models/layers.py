"""Building blocks shared by the decoder models: norms, activations, fused linears, attention.

Every module works on a flat batch: tensors are ``[num_tokens, ...]`` with the tokens of
all requests of a step concatenated, no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention.backend import AttentionLayerSpec
from runtime.forward_context import get_forward_context
from runtime.models.ops import lookup


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled by ``weight`` (Llama, Qwen).

    ``norm(x)`` returns the normalized ``x``; ``norm(x, residual)`` first adds the
    residual stream and returns ``(norm(x + residual), x + residual)``, so that a
    platform's fused add-and-norm kernel can do both in one pass. The fused ops
    (``rms_norm``, ``fused_add_rms_norm``) are taken from the custom-ops scope the
    module is built in; without them it runs the plain torch code.
    """

    is_gemma = False  # passed to the fused ops as ``gemma``

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._rms_norm = lookup("rms_norm")
        self._fused_add_rms_norm = lookup("fused_add_rms_norm")

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _plain_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalize(x).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [..., hidden] -> out [..., hidden] (and the new residual [..., hidden])
        if residual is not None:
            if self._fused_add_rms_norm is not None:
                return self._fused_add_rms_norm(x, residual, self.weight, self.eps, gemma=self.is_gemma)
            x = residual = x + residual
        if self._rms_norm is not None:
            out = self._rms_norm(x, self.weight, self.eps, gemma=self.is_gemma)
        else:
            out = self._plain_norm(x)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant: the weight is stored as an offset, the scale is ``1 + weight``,
    and the product is taken in float32 before casting back."""

    is_gemma = True

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def _plain_norm(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalize(x) * (1.0 + self.weight.float())).to(x.dtype)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = ``[gate | up]``.

    Uses the scope's fused ``silu_and_mul`` when the platform offers one.
    """

    def __init__(self):
        super().__init__()
        self._silu_and_mul = lookup("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d]
        if self._silu_and_mul is not None:
            return self._silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (Hugging Face's ``gelu_pytorch_tanh``), input ``[gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def act_and_mul(name: str) -> nn.Module:
    """The gated activation for a Hugging Face ``hidden_act`` name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]()


def one_row_linear(gemv):
    """``F.linear``, with ``gemv`` (if given) for one-row inputs in 16-bit dtypes."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if gemv is not None and x.shape[0] == 1 and x.dtype != torch.float32:
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    return linear


class Linear(nn.Linear):
    """``nn.Linear`` that uses the platform's one-row kernel (``gemv``) for batch-1 steps."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self._linear = one_row_linear(lookup("gemv"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self._linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix, their rows stacked.

    ``shard_sizes`` names each projection (``{"q": ..., "k": ..., "v": ...}``) in row
    order; checkpoints keep them apart, and :meth:`load_shard` copies one in place.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        offset, size = self.shard_offsets[shard]
        target = param.data.narrow(0, offset, size)
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint shard {shard!r} of {param_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(tensor)


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Hands q/k/v to the step's attention backend, which owns the paged KV cache."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        self.spec = AttentionLayerSpec(
            layer_idx=layer_idx,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size]
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.spec.layer_idx]
        return ctx.backend.forward(self.spec, q, k, v, kv_cache, ctx.metadata)  # [T, num_heads, head_size]

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"layer={s.layer_idx}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, "
            f"head_size={s.head_size}, window={s.sliding_window}"
        )
