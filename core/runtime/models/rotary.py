"""Rotary position embedding (the "rotate half" layout of Hugging Face / GPT-NeoX).

The parameters are read the way transformers 5 stores them: ``config.rope_parameters``
(one dict, or one per layer type such as ``full_attention`` / ``sliding_attention``),
falling back to the older ``rope_scaling`` + ``rope_theta`` (+ Gemma 3's
``rope_local_base_freq`` for sliding layers).

Once per forward the model turns the step's positions into a :class:`Rotation` that
every layer applies to its queries and keys: the cos/sin of the angles
(:class:`AngleRotation`, plain torch), or the platform's fused in-place
``rotary_embedding`` kernel over a cos/sin cache (:class:`FusedRotation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.models.ops import lookup

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of one layer type as a flat dict with ``rope_type`` and ``rope_theta``."""
    params = getattr(config, "rope_parameters", None)
    layer_types = set(getattr(config, "layer_types", None) or ())
    if params and layer_types and set(params) <= layer_types | {"full_attention", "sliding_attention"}:
        params = params.get(layer_type or "full_attention")  # nested per layer type
    params = dict(params or getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        theta = getattr(config, "rope_theta", None)
        if layer_type == "sliding_attention":
            theta = getattr(config, "rope_local_base_freq", None) or theta
        params["rope_theta"] = theta if theta is not None else 10000.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(params: dict[str, Any], head_size: int, max_position: int) -> torch.Tensor:
    """``[head_size // 2]`` float32 inverse frequencies for the given RoPE settings."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported; only 1.0")
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params, max_position)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params.get("original_max_position_embeddings") or max_position
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_size] by the angles of ``cos``/``sin`` [T, head_size // 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass(frozen=True, slots=True)
class AngleRotation:
    """Plain torch: the step's ``cos``/``sin``, computed once and applied by every layer."""

    cos: torch.Tensor  # [T, head_size // 2]
    sin: torch.Tensor  # [T, head_size // 2]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, num_heads, head_size], k: [T, num_kv_heads, head_size] -> new rotated tensors
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


@dataclass(frozen=True, slots=True)
class FusedRotation:
    """A platform's ``rotary_embedding`` kernel, rotating q and k in place from a cos/sin cache."""

    op: Callable
    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_position, head_size] float32: cos | sin

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.op(self.positions, q, k, self.cos_sin_cache)


Rotation = AngleRotation | FusedRotation


class RotaryEmbedding(nn.Module):
    """Turns a batch of positions into the :class:`Rotation` the layers apply.

    The fused ``rotary_embedding`` op is taken from the custom-ops scope the module is
    built in; without it the rotation is plain torch.
    """

    def __init__(self, head_size: int, params: dict[str, Any], max_position: int):
        super().__init__()
        self.head_size = head_size
        self.rope_type = params["rope_type"]
        self.max_position = max_position
        # Plain attributes on the CPU (not buffers): models are built on the meta device
        # and cast to the activation dtype, and both tables must stay float32.
        self._inv_freq = inverse_frequencies(params, head_size, max_position)  # [head_size // 2] float32
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self._rotary_op = lookup("rotary_embedding")
        self._cos_sin_cache_on: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_for(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self._inv_freq.to(device)
        return self._inv_freq_on[device]

    def _cos_sin_cache_for(self, device: torch.device) -> torch.Tensor:
        """``[max_position, head_size]`` float32 cos | sin, built on ``device`` on first use."""
        if device not in self._cos_sin_cache_on:
            all_positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
            angles = all_positions[:, None] * self._inv_freq_for(device)[None, :]  # [max_position, head_size // 2]
            self._cos_sin_cache_on[device] = torch.cat((angles.cos(), angles.sin()), dim=-1)
        return self._cos_sin_cache_on[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, head_size // 2] in ``dtype``
        freqs = positions.float()[:, None] * self._inv_freq_for(positions.device)[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of the tokens at ``positions`` [T] for activations in ``dtype``."""
        if self._rotary_op is not None:
            return FusedRotation(self._rotary_op, positions, self._cos_sin_cache_for(positions.device))
        return AngleRotation(*self(positions, dtype))

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rope_type={self.rope_type}, fused={self._rotary_op is not None}"
