"""``compressed-tensors``: checkpoints written by llm-compressor / compressed-tensors.

``quantization_config`` has ``config_groups`` (each: ``targets``, ``weights``,
``input_activations``, optional ``format``), a top-level ``format`` and an ``ignore`` list;
targets and ignore entries are module class names (``Linear``), module names, or
``re:REGEX``. Supported: 8-bit symmetric ``float`` (``float-quantized``) and ``int``
(``int-quantized``, ``naive-quantized``) weights per tensor, channel or block, with
activations per token / tensor (static or dynamic) / group, or none (weights only).
Tensors: ``weight``, ``weight_scale``, ``input_scale`` (static), zero points (zeros).

``pack-quantized``: 4/8-bit ``int`` weights per group or channel, symmetric or not, with
16/32-bit activations (W4A16, W8A16): ``weight_packed`` int32 [out, in / pack],
``weight_scale`` [out, groups], ``weight_zero_point`` int32 [out / pack, groups]
(asymmetric), ``weight_shape`` [2]; read by :mod:`runtime_quant.wna16_linear`. ``actorder``
none, ``weight`` or its alias ``static`` (calibration order only), or ``group`` (alias
``dynamic``, older checkpoints): ``weight_g_idx`` [in] gives each input column its group.

A layer matching several groups' targets takes the most specific one, as compressed-tensors
assigns them: a module name, then a ``re:`` pattern (in sorted order), then the class ``Linear``.
``kv_cache_scheme`` (8-bit float per tensor, static) is read by the core (``self_attn.k_scale`` /
``v_scale``, used by an fp8 KV cache); a config may hold only that, its linear layers unquantized.

Refused: a ``sparsity_config`` of another format than ``dense`` (weights stored compressed) and a
``transform_config`` with transforms (weights rotated; the model would have to rotate too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime_quant.linear import W8A8LinearMethod
from runtime_quant.scheme import FP8, INT8, W8A8Scheme, matches, verify_8bit_platform
from runtime_quant.wna16_linear import WNA16LinearMethod
from runtime_quant.wna16_scheme import WNA16Scheme, check_bits, check_group_size

PACKED = "pack-quantized"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", PACKED)
DENSE = "dense"  # the sparsity_config format of weights stored whole (the only one read here)
LINEAR_CLASS = "Linear"  # every layer this method is asked about is a linear layer
ACTORDER_PLAIN = (None, "weight", "static")  # "static": compressed-tensors' alias of "weight"
ACTORDER_G_IDX = ("group", "dynamic")  # "dynamic": its alias of "group"
KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}


def detect(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "compressed-tensors"


def _fail(group: str, what: str) -> ValueError:
    return ValueError(
        f"compressed-tensors config group {group!r}: {what} is not supported; supported: 8-bit symmetric "
        f"float or int weights per tensor, channel or block, formats {', '.join(FORMATS[:-1])}; 4/8-bit int "
        f"weights per group or channel with 16/32-bit activations, format {PACKED}"
    )


def packed_scheme(group: str, spec: dict[str, Any]) -> WNA16Scheme:
    """The :class:`WNA16Scheme` of a ``pack-quantized`` config group."""
    weights = spec.get("weights") or {}
    if spec.get("input_activations") or spec.get("output_activations"):
        raise _fail(group, f"{PACKED} with quantized activations")
    if weights.get("type") != "int" or weights.get("dynamic"):
        raise _fail(group, f"{PACKED} {weights.get('type')} weights{' (dynamic)' if weights.get('dynamic') else ''}")
    actorder = weights.get("actorder")
    if actorder not in ACTORDER_PLAIN + ACTORDER_G_IDX:
        raise ValueError(f"compressed-tensors config group {group!r}: {PACKED} actorder {actorder!r} is not supported; "
                         f"supported: {', '.join(str(a).lower() for a in ACTORDER_PLAIN + ACTORDER_G_IDX)}")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _fail(group, f"{PACKED} weight strategy {strategy!r}")
    group_size = weights.get("group_size") if strategy == "group" else -1
    prefix = f"compressed-tensors config group {group!r}:"
    check_bits(f"{prefix} {PACKED} num_bits", weights.get("num_bits"))
    check_group_size(f"{prefix} {PACKED} group_size", group_size)
    return WNA16Scheme("compressed-tensors", weights["num_bits"], group_size, symmetric=weights.get("symmetric", True),
                       act_order=actorder in ACTORDER_G_IDX)


def _dtype(group: str, args: dict[str, Any]) -> Any:
    kind, bits = args.get("type"), args.get("num_bits")
    if bits != 8 or kind not in ("float", "int"):
        raise _fail(group, f"{bits}-bit {kind}")
    if args.get("symmetric") is False:
        raise _fail(group, "asymmetric quantization (zero points)")
    return FP8 if kind == "float" else INT8


def _block_structure(group: str, weights: dict[str, Any]) -> tuple[int, int]:
    block = weights.get("block_structure")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ValueError(f"compressed-tensors config group {group!r}: block weights need block_structure "
                         f"[rows, columns] (two positive integers), got {block!r}")
    return tuple(block)


def group_scheme(group: str, spec: dict[str, Any], default_format: str | None) -> W8A8Scheme | WNA16Scheme:
    """The :class:`W8A8Scheme` of one config group."""
    fmt = spec.get("format") or default_format
    if fmt not in FORMATS:
        raise _fail(group, f"format {fmt!r}")
    if fmt == PACKED:
        return packed_scheme(group, spec)
    weights, acts = spec.get("weights") or {}, spec.get("input_activations")
    if spec.get("output_activations"):
        raise _fail(group, "output activation quantization")
    dtype = _dtype(group, weights)
    strategy = weights.get("strategy")
    if weights.get("dynamic") or strategy not in ("tensor", "channel", "block"):
        raise _fail(group, f"weight strategy {strategy!r}{' (dynamic)' if weights.get('dynamic') else ''}")
    block = _block_structure(group, weights) if strategy == "block" else None
    if acts is None:
        return W8A8Scheme(dtype, strategy, activations=None, block_size=block)
    if _dtype(group, acts) != dtype:
        raise _fail(group, f"{acts.get('type')} activations with {weights.get('type')} weights")
    act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if act_strategy not in ("token", "tensor", "group") or (act_strategy != "tensor" and not dynamic):
        raise _fail(group, f"{'dynamic' if dynamic else 'static'} activation strategy {act_strategy!r}")
    if act_strategy == "group" and (block is None or acts.get("group_size") != block[1]):
        raise _fail(group, f"activation groups of {acts.get('group_size')} with weight blocks {block}")
    return W8A8Scheme(dtype, strategy, activations=act_strategy, static_activations=not dynamic, block_size=block)


def _specific_first(targets) -> list[str]:
    """Targets in compressed-tensors' order of precedence: module names, then ``re:`` patterns
    (each sorted), then the class name ``Linear`` (``compressed_tensors.utils.match_targets``)."""
    return sorted(targets, key=lambda t: (t == LINEAR_CLASS, t.startswith("re:"), t))


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """Config groups in order and the ignore list. A layer takes the scheme of its most specific
    matching target (a later group's scheme for a target named twice), as compressed-tensors does."""

    groups: tuple[tuple[tuple[str, ...], W8A8Scheme | WNA16Scheme], ...]
    ignore: tuple[str, ...] = ()

    def linear_method(self, prefix: str) -> W8A8LinearMethod | WNA16LinearMethod | None:
        if any(matches(prefix, pattern) for pattern in self.ignore):
            return None
        schemes = {target: scheme for targets, scheme in self.groups for target in targets}
        for target in _specific_first(schemes):
            if target == LINEAR_CLASS or matches(prefix, target):
                scheme = schemes[target]
                return WNA16LinearMethod(scheme) if isinstance(scheme, WNA16Scheme) else W8A8LinearMethod(scheme)
        return None

    def verify_platform(self, platform) -> None:
        for _, scheme in self.groups:
            if isinstance(scheme, W8A8Scheme):
                verify_8bit_platform(platform, scheme)


class CompressedTensorsMethod:
    """:class:`runtime.quantization.QuantMethod` ``compressed-tensors``."""

    supports_tensor_parallel = True  # its layers load each rank's part (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> CompressedTensorsConfig:
        config = quantization_config or {}
        kv_cache_scheme = config.get("kv_cache_scheme")
        if kv_cache_scheme is not None:
            check_kv_cache_scheme(kv_cache_scheme)
        if not config.get("config_groups") and kv_cache_scheme is None:
            raise ValueError(
                "compressed-tensors reads quantized checkpoints (a quantization_config with config_groups or a "
                "kv_cache_scheme); to quantize a 16/32-bit checkpoint on load use --quantization fp8 or int8"
            )
        sparsity = (config.get("sparsity_config") or {}).get("format") or DENSE
        if sparsity != DENSE:
            raise ValueError(
                f"compressed-tensors sparsity_config format {sparsity!r} (sparse weights) is not supported; "
                f"supported: {DENSE}"
            )
        if (config.get("transform_config") or {}).get("config_groups"):
            raise ValueError("compressed-tensors transform_config (weights rotated by Hadamard / learned transforms that "
                             "the model must apply at run time) is not supported; supported: checkpoints without one")
        default_format = config.get("format")
        groups = tuple(
            (tuple(spec.get("targets") or ()), group_scheme(name, spec, default_format))
            for name, spec in (config.get("config_groups") or {}).items()
        )
        return CompressedTensorsConfig(groups, tuple(config.get("ignore") or ()))


def check_kv_cache_scheme(scheme: Any) -> None:
    """The KV cache scales the core reads: one static FP8 scale per layer for keys and one for values."""
    if not isinstance(scheme, dict):
        raise ValueError(f"compressed-tensors kv_cache_scheme must be an object, got {scheme!r}")
    # compressed-tensors' QuantizationArgs defaults, for fields a config leaves out
    values = {**{"type": "int", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False},
              **{k: v for k, v in scheme.items() if v is not None}}
    bad = {k: values[k] for k, v in KV_CACHE_SCHEME.items() if values[k] != v}
    if bad:
        found = ", ".join(f"{k} {v!r}" for k, v in bad.items())
        supported = ", ".join(f"{k} {v!r}" for k, v in KV_CACHE_SCHEME.items())
        raise ValueError(f"compressed-tensors kv_cache_scheme with {found} is not supported; supported: {supported} "
                         "(one FP8 scale per layer for keys and one for values)")
