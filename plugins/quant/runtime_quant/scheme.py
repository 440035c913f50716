"""What an 8-bit linear layer stores and how its activations are quantized.

One :class:`W8A8Scheme` describes every layout this plugin reads: the ``fp8`` method's
(online per-channel, per-tensor checkpoints, 128x128 blocks), ``int8`` (online per-channel)
and the ``float-quantized`` / ``int-quantized`` schemes of compressed-tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("token", "tensor", "group")  # or None: weights only (W8A16)
# Smallest scale, so that an all-zero row quantizes to zeros rather than NaN (vLLM's 1 / (448 * 512)).
MIN_SCALE = 1.0 / (448.0 * 512.0)


def quant_max(dtype: torch.dtype) -> float:
    """Largest magnitude of an 8-bit code: 448 for float8_e4m3fn, 127 for int8."""
    return float(torch.finfo(dtype).max) if dtype.is_floating_point else 127.0


@dataclass(frozen=True)
class W8A8Scheme:
    """8-bit weights (``weight_dtype``) and, unless ``activations`` is None, 8-bit activations."""

    weight_dtype: torch.dtype  # FP8 or INT8
    weight_strategy: str  # "tensor": one scale per projection; "channel": per output row; "block"
    activations: str | None = "token"  # "token" (per row), "tensor", "group" (per block_size[1] columns)
    static_activations: bool = False  # "tensor" activations scaled by the checkpoint's input_scale
    block_size: tuple[int, int] | None = None  # (rows, columns) of one weight block
    online: bool = False  # the checkpoint holds high-precision weights; quantize them after loading
    weight_scale_name: str = "weight_scale"  # "weight_scale_inv" in fp8 block checkpoints

    def __post_init__(self) -> None:
        if self.weight_dtype not in (FP8, INT8):
            raise ValueError(f"8-bit weights are float8_e4m3fn or int8, got {self.weight_dtype}")
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight strategy {self.weight_strategy!r}; supported: {', '.join(WEIGHT_STRATEGIES)}")
        if self.activations is not None and self.activations not in ACTIVATION_STRATEGIES:
            raise ValueError(
                f"activation strategy {self.activations!r}; supported: {', '.join(ACTIVATION_STRATEGIES)} or none"
            )
        if (self.weight_strategy == "block") != (self.block_size is not None):
            raise ValueError("block-wise weights need a block size (and only they take one)")
        if self.static_activations and self.activations != "tensor":
            raise ValueError("static activation scales (input_scale) are per tensor only")
        if self.activations == "group" and self.block_size is None:
            raise ValueError("per-group activations go with block-wise weights")

    @property
    def describe(self) -> str:
        """``fp8 weights per channel, dynamic per-token activations`` (for error messages)."""
        weights = "fp8" if self.weight_dtype == FP8 else "int8"
        strategy = f"{list(self.block_size)} blocks" if self.block_size else f"per {self.weight_strategy}"
        if self.activations is None:
            acts = "16/32-bit activations"
        else:
            acts = f"{'static' if self.static_activations else 'dynamic'} per-{self.activations} activations"
        return f"{weights} weights {strategy}{' (quantized on load)' if self.online else ''}, {acts}"


def matches(prefix: str, pattern: str) -> bool:
    """A checkpoint module name against an ignore/target entry: a name (the whole module
    name or its last dotted parts) or ``re:REGEX`` (compressed-tensors' form, ``re.match``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return prefix == pattern or prefix.endswith("." + pattern)


def skips(prefix: str, entry: str) -> bool:
    """An ``ignored_layers`` / ``modules_to_not_convert`` entry against a checkpoint module name:
    the whole name, its last dotted parts, a module holding it (``model.layers.1``, ``mlp``:
    transformers' and vLLM's prefix reading of these lists) or ``re:REGEX``. Dotted parts match
    whole, so ``layers.1`` does not skip ``layers.10``."""
    if entry.startswith("re:"):
        return matches(prefix, entry)
    return f".{entry.strip('.')}." in f".{prefix}."


def verify_8bit_platform(platform, scheme: W8A8Scheme) -> None:
    """FP8 GEMMs on CUDA need FP8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    if scheme.weight_dtype != FP8 or getattr(platform, "name", None) != "cuda" or not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ValueError(
            f"{scheme.describe} needs a GPU with FP8 tensor cores (compute capability >= 8.9); "
            f"this GPU is {capability[0]}.{capability[1]}: use int8 or an unquantized checkpoint"
        )
