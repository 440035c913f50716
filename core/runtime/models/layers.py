"""Building blocks shared by the decoder models: norms, activations, fused linears, attention.

Every module works on a flat batch: tensors are ``[num_tokens, ...]`` with the tokens of
all requests of a step concatenated, no padding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention.backend import AttentionLayerSpec
from runtime.forward_context import get_forward_context
from runtime.models.linear import Linear, MergedLinear, RowParallelLinear, one_row_linear
from runtime.models.ops import lookup
from runtime.models.rotary import FusedRotation, Rotation

logger = logging.getLogger(__name__)

__all__ = ["Linear", "MergedLinear", "one_row_linear"]  # kept here for the layers that import them from this module


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled by ``weight`` (Llama, Qwen).

    ``norm(x)`` returns the normalized ``x``; ``norm(x, residual)`` first adds the
    residual stream and returns ``(norm(x + residual), x + residual)``, so that a
    platform's fused add-and-norm kernel can do both in one pass. The fused ops
    (``rms_norm``, ``fused_add_rms_norm``) are taken from the custom-ops scope the
    module is built in; without them it runs the plain torch code. With ``rms_norm_gemv``
    too, :meth:`fused_into` does the norm inside the next layer's one-row gemv.
    """

    is_gemma = False  # passed to the fused ops as ``gemma``

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._rms_norm = lookup("rms_norm")
        self._fused_add_rms_norm = lookup("fused_add_rms_norm")
        self._rms_norm_gemv = lookup("rms_norm_gemv")

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def fused_into(
        self, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(linear(self(s)), s)`` with ``s = x + residual`` (``x`` without a residual) in one
        ``rms_norm_gemv`` kernel, or one of ``linear``'s quantized kernels (:meth:`Linear.quant_fused`),
        or None where the platform offers none or ``linear`` would not run the one-row gemv (see
        :meth:`Linear.gemv_operands`) and its linear method fuses none. ``linear``'s input must be whole
        on every rank (replicated or column-parallel), as a norm's output is. ``gated``: ``linear`` is a
        column-parallel ``[gate | up]`` projection and the first result ``silu(gate) * up`` of its
        output, from the ``rms_norm_gemv`` kernel only."""
        operands = None if self._rms_norm_gemv is None else linear.gemv_operands(x)
        if operands is not None:
            extra = {"gated": True} if gated else {}
            out, residual = self._rms_norm_gemv(x, residual, self.weight, self.eps, self.is_gemma, *operands, **extra)
            return linear.reduce_output(out), residual
        if gated:
            return None
        fused = linear.quant_fused("apply_rms_norm", x, residual, self.weight, self.eps, self.is_gemma)
        return None if fused is None else (linear.reduce_output(fused[0]), fused[1])

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


def pre_norm(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm: ``norm(hidden + residual)`` and the new residual.

    The first layer has no residual yet; its input is the embeddings themselves.
    """
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def norm_into(
    norm: nn.Module, linear: Linear, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(s)), s)`` with ``s = hidden + residual`` (as :func:`pre_norm`): one kernel
    where an :class:`RMSNorm` can fuse into ``linear`` (:meth:`RMSNorm.fused_into`); any other
    norm module, called as ``norm(x)`` / ``norm(x, residual)``, runs as it is."""
    fused = norm.fused_into(linear, hidden, residual) if isinstance(norm, RMSNorm) else None
    if fused is not None:
        return fused
    out, residual = pre_norm(norm, hidden, residual)
    return linear(out), residual


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = ``[gate | up]``.

    Uses the scope's fused ``silu_and_mul`` when the platform offers one, and with
    ``silu_and_mul_gemv`` :meth:`fused_into` computes it inside the next layer's one-row gemv.
    """

    def __init__(self):
        super().__init__()
        self._silu_and_mul = lookup("silu_and_mul")
        self._silu_and_mul_gemv = lookup("silu_and_mul_gemv")

    def fused_into(self, linear: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``linear(self(x))`` in one ``silu_and_mul_gemv`` kernel, or one of ``linear``'s quantized
        kernels (:meth:`Linear.quant_fused`), or None where the platform offers none or ``linear``
        would not run the one-row gemv (see :meth:`Linear.gemv_operands`) and its method fuses none.
        ``x`` [1, 2 * d] is this rank's ``[gate | up]``, whose ``d`` columns ``linear`` reads."""
        operands = None if self._silu_and_mul_gemv is None else linear.gemv_operands(x)
        if operands is not None:
            return linear.reduce_output(self._silu_and_mul_gemv(x, *operands))
        fused = linear.quant_fused("apply_silu_and_mul", x)
        return None if fused is None else linear.reduce_output(fused)

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


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` with gate and up fused.

    With tensor parallelism each rank computes a slice of the intermediate features
    (gate/up column-parallel) and ``down`` sums the ranks' partial outputs.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down(self.gate_up_proj(x))

    def after_norm(
        self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(s)), s)`` with ``s = hidden + residual`` (as :func:`norm_into`). On batch-1 steps
        of a SiLU MLP after an :class:`RMSNorm` the norm, the gate/up projection and the activation
        may be one kernel (:meth:`RMSNorm.fused_into` with ``gated``), else the norm goes into gate/up
        and the activation into down where each can (:func:`norm_into`, :meth:`down`)."""
        if isinstance(self.act_fn, SiluAndMul) and isinstance(norm, RMSNorm):
            fused = norm.fused_into(self.gate_up_proj, hidden, residual, gated=True)
            if fused is not None:
                return self.down_proj(fused[0]), fused[1]
        gate_up, residual = norm_into(norm, self.gate_up_proj, hidden, residual)
        return self.down(gate_up), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * intermediate / tp] -> [T, hidden]
        """``down_proj(act(gate_up))``, in one kernel where the activation fuses into ``down_proj``."""
        fused = self.act_fn.fused_into(self.down_proj, gate_up) if isinstance(self.act_fn, SiluAndMul) else None
        return fused if fused is not None else self.down_proj(self.act_fn(gate_up))


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
        self.cache_index = layer_idx  # its KV cache among the step's (a pipeline stage holds some layers)
        self.k_scale = self.v_scale = 1.0  # a checkpoint's per-tensor KV cache scales (``self_attn.k_scale`` ...)
        self.kv_scales: tuple[float, float] | None = None  # in use: set for an 8-bit cache (apply_kv_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: Rotation | None = None) -> torch.Tensor:
        # q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size]; ``rotation``: to apply to q and k first,
        # which a backend that ``fuses_rotary`` does as it stores the keys
        scales = self.kv_scales
        if rotation is not None and (scales is not None or torch.compiler.is_compiling()
                                     or not isinstance(rotation, FusedRotation)
                                     or not getattr(get_forward_context().backend, "fuses_rotary", False)):
            q, k = rotation.apply(q, k)
            rotation = None
        if scales is not None:
            # The cache holds k / k_scale and v / v_scale (vLLM's scaled FP8 cache); every backend
            # stores what it is given, so the scales go around it: q . k = (q * k_scale) . (k / k_scale),
            # and the output of values divided by v_scale is v_scale times too small.
            q, k, v = q * scales[0], k / scales[0], v / scales[1]
        if torch.compiler.is_compiling():  # the backend runs eagerly inside compiled code (runtime.models.attention_op)
            from runtime.models.attention_op import compiled_attention

            out = compiled_attention(self.spec, self.cache_index, q, k, v)
        else:
            ctx = get_forward_context()
            kv_cache = ctx.kv_caches[self.cache_index]
            if rotation is None:
                out = ctx.backend.forward(self.spec, q, k, v, kv_cache, ctx.metadata)  # [T, num_heads, head_size]
            else:
                out = ctx.backend.forward(self.spec, q, k, v, kv_cache, ctx.metadata, rotation=rotation)
        return out if scales is None else out * scales[1]

    def set_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's scale for keys (``k``), values (``v``) or both (``kv``, the older single one)."""
        if which in ("k", "kv"):
            self.k_scale = value
        if which in ("v", "kv"):
            self.v_scale = value

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"layer={s.layer_idx}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, "
            f"head_size={s.head_size}, window={s.sliding_window}"
        )


def apply_kv_scales(model: nn.Module, cache_is_8bit: bool) -> int:
    """Use the checkpoint's KV cache scales in every attention layer that has them when the cache
    is 8-bit (as vLLM does; a 16-bit cache stores keys and values as they are). Returns the
    number of layers that scale."""
    scaled = [m for m in model.modules() if isinstance(m, Attention) and (m.k_scale, m.v_scale) != (1.0, 1.0)]
    for layer in scaled:
        layer.kv_scales = (layer.k_scale, layer.v_scale) if cache_is_8bit else None
    if scaled and not cache_is_8bit:
        logger.info("the checkpoint's KV cache scales (%d layers) are not used: they apply to an 8-bit cache "
                    "(--kv-cache-dtype fp8)", len(scaled))
    return len(scaled) if cache_is_8bit else 0
