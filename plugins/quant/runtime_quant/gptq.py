"""``gptq``: checkpoints written by AutoGPTQ / GPTQModel / optimum (``quant_method: gptq``).

Tensors per linear layer: ``qweight`` int32 [in / pack, out] (codes packed along the input
dimension), ``qzeros`` int32 [groups, out / pack], ``scales`` float16 [groups, out] and
``g_idx`` int32 [in] (each input row's group; read only with ``desc_act``, act-order).
Zero points are stored as ``z - 1`` in the original format (``checkpoint_format: gptq``,
also when absent) and as ``z`` in GPTQModel's ``gptq_v2``. Supported: 4 and 8 bits, group
sizes -1, 16 ... 256, symmetric or not, with or without act-order. ``lm_head`` stays
unquantized unless ``lm_head: true``; ``modules_to_not_convert`` are skipped.

Which layers are quantized: optimum's ``modules_in_block_to_quantize`` (names inside a decoder
block, a list or a list of lists) limits the quantized layers of each block to those it names
(the others are stored 16-bit); GPTQModel's ``dynamic`` maps ``re.match`` patterns over module
names to overrides: ``-:PATTERN`` leaves the layer unquantized, ``+:PATTERN`` (or ``PATTERN``)
gives it its own ``bits`` / ``group_size`` / ``sym`` / ``desc_act``; the first matching rule wins.
"""

from __future__ import annotations

import re
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
    """One weight-only scheme for every linear layer but ``lm_head`` (unless quantized) and the skipped
    ones; GPTQ may limit the layers of a block (``in_block``) and give some their own scheme (``dynamic``)."""

    scheme: WNA16Scheme
    skipped: tuple[str, ...] = ()
    quantize_lm_head: bool = False
    in_block: tuple[str, ...] | None = None  # modules_in_block_to_quantize, flattened (None: every layer)
    dynamic: tuple[tuple[str, WNA16Scheme | None], ...] = ()  # (pattern, its scheme or None: unquantized)

    def linear_method(self, prefix: str) -> WNA16LinearMethod | None:
        if prefix == "lm_head" and not self.quantize_lm_head:
            return None
        if any(skips(prefix, name) for name in self.skipped):
            return None
        if self.in_block is not None and prefix != "lm_head" and not any(skips(prefix, n) for n in self.in_block):
            return None
        scheme = next((override for pattern, override in self.dynamic if re.match(pattern, prefix)), self.scheme)
        return None if scheme is None else WNA16LinearMethod(scheme)


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
        if config.get("is_marlin_format"):  # AutoGPTQ's Marlin export: tensors B and s, not qweight
            raise ValueError("gptq quantization_config.is_marlin_format true (Marlin-packed tensors) is not supported; "
                             f"supported: checkpoint_format {', '.join(CHECKPOINT_FORMATS)}")
        if str(config.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":
            raise ValueError(f"gptq quantization_config.pack_dtype {config['pack_dtype']!r} is not supported; "
                             "supported: int32")
        scheme = _scheme(config, "gptq quantization_config", CHECKPOINT_FORMATS[fmt])
        skipped = tuple(config.get("modules_to_not_convert") or ())
        return WNA16Config(scheme, skipped, quantize_lm_head=_flag(config, "lm_head", False, "gptq quantization_config"),
                           in_block=_in_block(config.get("modules_in_block_to_quantize")),
                           dynamic=_dynamic(config.get("dynamic"), scheme))


def _scheme(config: dict[str, Any], where: str, zero_offset: int, base: WNA16Scheme | None = None) -> WNA16Scheme:
    """The scheme of ``config``'s ``bits`` / ``group_size`` / ``sym`` / ``desc_act`` (unset: ``base``'s)."""
    symmetric = _flag(config, "sym", base.symmetric if base else True, where)
    act_order = _flag(config, "desc_act", base.act_order if base else False, where)
    bits = config.get("bits", base.bits if base else None)
    group_size = config.get("group_size", base.group_size if base else -1)
    try:
        return WNA16Scheme("gptq", bits, group_size, symmetric=symmetric, act_order=act_order, zero_offset=zero_offset)
    except ValueError as exc:
        if base is None:
            raise
        raise ValueError(f"{where}: {exc}") from None


def _in_block(value: Any) -> tuple[str, ...] | None:
    """``modules_in_block_to_quantize`` flattened: ``[["self_attn.q_proj", ...], ["mlp.down_proj"]]``."""
    if not value:
        return None
    names = [n for item in value for n in (item if isinstance(item, list) else [item])] if isinstance(value, list) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ValueError("gptq quantization_config.modules_in_block_to_quantize must be a list of module names "
                         f"(or of lists of them), such as [[\"self_attn.q_proj\"], [\"mlp.down_proj\"]]; got {value!r}")
    return tuple(names)


def _dynamic(rules: Any, base: WNA16Scheme) -> tuple[tuple[str, WNA16Scheme | None], ...]:
    """GPTQModel's ``dynamic``: ``{"-:PATTERN": {}, "+:PATTERN": {"bits": 8, ...}}`` in order."""
    if not rules:
        return ()
    if not isinstance(rules, dict):
        raise ValueError(f"gptq quantization_config.dynamic must map module name patterns to overrides, got {rules!r}")
    parsed = []
    for key, override in rules.items():
        where = f"gptq quantization_config.dynamic[{key!r}]"
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{where}: {pattern!r} is not a regular expression ({exc})") from None
        if not isinstance(override, dict):
            raise ValueError(f"{where} must be an object of overrides (bits, group_size, sym, desc_act), got {override!r}")
        parsed.append((pattern, None if key.startswith("-:") else _scheme(override, where, base.zero_offset, base)))
    return tuple(parsed)


def _flag(config: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A true/false field of the quantization_config: JSON booleans (or null for the default); a string
    such as "false" would read as true, so anything else is refused, naming the field."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r}")
    return value
