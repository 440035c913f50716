"""``fp8``: online FP8 of a 16/32-bit checkpoint, and checkpoints with ``quant_method: fp8``.

Checkpoint layout (vLLM's / transformers' FP8 format): ``<layer>.weight`` float8_e4m3fn
[out, in] with ``<layer>.weight_scale`` (one float32 per tensor) and, for
``activation_scheme: static``, ``<layer>.input_scale``; with ``weight_block_size: [128, 128]``
the scales are ``<layer>.weight_scale_inv`` [ceil(out/128), ceil(in/128)] and activations
are quantized per token and 128-column group. ``ignored_layers`` (vLLM) or
``modules_to_not_convert`` (transformers) stay unquantized, and so does ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime_quant.linear import W8A8LinearMethod, fp8_online_scheme
from runtime_quant.scheme import FP8, W8A8Scheme, skips, verify_8bit_platform

ACTIVATION_SCHEMES = ("static", "dynamic")


def detect(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "fp8"


@dataclass(frozen=True)
class W8A8Config:
    """One scheme for every linear layer but ``lm_head`` and the ``ignored`` ones."""

    scheme: W8A8Scheme
    ignored: tuple[str, ...] = ()

    def linear_method(self, prefix: str) -> W8A8LinearMethod | None:
        if prefix == "lm_head" or any(skips(prefix, name) for name in self.ignored):
            return None
        return W8A8LinearMethod(self.scheme)

    def verify_platform(self, platform) -> None:
        verify_8bit_platform(platform, self.scheme)


def checkpoint_scheme(config: dict[str, Any]) -> W8A8Scheme:
    """The scheme of an fp8 checkpoint's ``quantization_config``."""
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ACTIVATION_SCHEMES:
        raise ValueError(
            f"fp8 quantization_config.activation_scheme {activation!r} is not supported; "
            f"supported: {', '.join(ACTIVATION_SCHEMES)}"
        )
    block = config.get("weight_block_size")
    if block is None:
        return W8A8Scheme(FP8, "tensor", activations="tensor" if activation == "static" else "token",
                          static_activations=activation == "static")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization_config.weight_block_size must be two positive integers, got {block!r}")
    if activation == "static":
        raise ValueError("fp8 block-wise weights (weight_block_size) need activation_scheme 'dynamic', got 'static'")
    return W8A8Scheme(FP8, "block", activations="group", block_size=tuple(block), weight_scale_name="weight_scale_inv")


class Fp8Method:
    """:class:`runtime.quantization.QuantMethod` ``fp8``."""

    supports_tensor_parallel = True  # its layers load each rank's part (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> W8A8Config:
        if quantization_config is None:
            return W8A8Config(fp8_online_scheme())
        ignored = quantization_config.get("ignored_layers") or quantization_config.get("modules_to_not_convert") or ()
        return W8A8Config(checkpoint_scheme(quantization_config), tuple(ignored))
