"""``gptq``: checkpoints written by AutoGPTQ / GPTQModel / optimum (``quant_method: gptq``).

Tensors per linear layer: ``qweight`` int32 [in / pack, out] (codes packed along the input
dimension), ``qzeros`` int32 [groups, out / pack], ``scales`` float16 [groups, out] and
``g_idx`` int32 [in] (each input row's group; read only with ``desc_act``, act-order).
Zero points are stored as ``z - 1`` in the original format (``checkpoint_format: gptq``,
also when absent) and as ``z`` in GPTQModel's ``gptq_v2``. Supported: 4 and 8 bits, group
sizes -1, 16 ... 256, symmetric or not, with or without act-order. ``lm_head`` stays
unquantized unless ``lm_head: true``; ``modules_to_not_convert`` are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime_quant.scheme import skips
from runtime_quant.wna16_linear import WNA16LinearMethod
from runtime_quant.wna16_scheme import WNA16Scheme

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what to add to a stored zero point


def detect(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "gptq"


@dataclass(frozen=True)
class WNA16Config:
    """One weight-only scheme for every linear layer but ``lm_head`` (unless quantized) and the skipped ones."""

    scheme: WNA16Scheme
    skipped: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def linear_method(self, prefix: str) -> WNA16LinearMethod | None:
        if prefix == "lm_head" and not self.quantize_lm_head:
            return None
        if any(skips(prefix, name) for name in self.skipped):
            return None
        return WNA16LinearMethod(self.scheme)


def needs_checkpoint(method: str, quantization_config: dict[str, Any] | None) -> dict[str, Any]:
    if not quantization_config:
        raise ValueError(
            f"{method} reads quantized checkpoints (a quantization_config with quant_method {method!r}); "
            "to quantize a 16/32-bit checkpoint on load use --quantization fp8 or int8"
        )
    return quantization_config


class GptqMethod:
    """:class:`runtime.quantization.QuantMethod` ``gptq``."""

    supports_tensor_parallel = True  # its layers load each rank's part (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> WNA16Config:
        config = needs_checkpoint("gptq", quantization_config)
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"gptq quantization_config.checkpoint_format {fmt!r} is not supported; "
                f"supported: {', '.join(CHECKPOINT_FORMATS)}"
            )
        if config.get("dynamic"):
            raise ValueError("gptq quantization_config.dynamic (per-module bits or group sizes) is not supported")
        scheme = WNA16Scheme(
            "gptq", config.get("bits"), config.get("group_size", -1), symmetric=_flag(config, "sym", True),
            act_order=_flag(config, "desc_act", False), zero_offset=CHECKPOINT_FORMATS[fmt],
        )
        skipped = tuple(config.get("modules_to_not_convert") or ())
        return WNA16Config(scheme, skipped, quantize_lm_head=_flag(config, "lm_head", False))


def _flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false field of the quantization_config: JSON booleans (or null for the default); a string
    such as "false" would read as true, so anything else is refused, naming the field."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"gptq quantization_config.{key} must be true or false, got {value!r}")
    return value
