"""The quantization contract: method -> per-checkpoint config -> per-layer linear method.

A quant method plugin registers a :class:`QuantMethod` through ``register_quant_methods``.
When a checkpoint is loaded with ``--quantization NAME`` (or a method's ``detect`` claims
it), the engine asks the method for a :class:`QuantConfig` built from the checkpoint's
``quantization_config``; while the model is built, every linear layer asks that config,
by its weight-name prefix (``model.layers.0.self_attn.qkv_proj``), for its
:class:`LinearMethod`, or None to stay unquantized (an ignore list). The linear method
creates the layer's parameters, receives the checkpoint tensors that belong to it,
repacks them once loading is done, and computes the layer's output.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class LinearMethod(Protocol):
    """How one linear layer stores its weights and computes ``x @ W.T (+ bias)``."""

    def create_weights(
        self, layer: torch.nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (packed weights, scales, zero points) on ``layer``.

        ``output_sizes`` lists the fused outputs (q, k, v or gate, up) in order; their sum is
        the layer's output size.
        """

    def load(self, layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy the checkpoint tensor ``name`` (``weight``, ``weight_scale``, ``qzeros`` ...) into
        the layer; ``shard`` is the index into ``output_sizes`` for fused layers, else None.
        Raise ValueError naming the tensor and the expected layout when it does not fit."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert the loaded tensors once, before the first forward pass."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [num_tokens, input_size] -> [num_tokens, sum(output_sizes)] in ``x``'s dtype."""

    # Optional: ``gemv_weights(layer, dtype) -> (weight, scale) | None``: where ``apply`` of one
    # row of ``dtype`` is ``runtime_kernels.gemv.gemv(x, weight, bias, scale=scale)`` (8-bit codes
    # [out, in] and float32 row scales [out]), those two, so that a norm or activation before the
    # layer (or the SiLU after a gate/up layer) may fuse into that gemv (``Linear.gemv_operands``);
    # None otherwise. A method with neither this nor the forms below is never fused with the op before it.
    # Optional, for methods with kernels of their own that can compute the op before the layer as they
    # read its input (decode steps; ``Linear.quant_fused``); each returns None where it does not, and
    # the ops run apart:
    #   ``apply_rms_norm(layer, x, residual, norm_weight, eps, gemma, bias) -> (out, s) | None``:
    #     ``s = x + residual`` (``x`` itself when ``residual`` is None) and ``out = apply(layer,
    #     rms_norm(s, norm_weight, eps, gemma), bias)``, rounded as the ``fused_add_rms_norm`` op
    #     rounds (:mod:`runtime.models.ops`); inputs untouched;
    #   ``apply_silu_and_mul(layer, x, bias) -> out | None``: ``apply(layer, silu_and_mul(x), bias)``
    #     for ``x`` = ``[gate | up]``.
    # Only shapes, dtypes and build-time state may decide between the result and None (CUDA graphs).


@runtime_checkable
class QuantConfig(Protocol):
    """One checkpoint's quantization settings."""

    def linear_method(self, prefix: str) -> LinearMethod | None:
        """The method for the linear layer at weight-name ``prefix``, or None to leave it unquantized.

        ``prefix`` is the checkpoint's name (``model.layers.0.self_attn.q_proj``, ``lm_head``); a
        fused layer asks once per projection it holds and gets one method for all of them.
        """

    # Optional: ``verify_platform(platform)`` raises ValueError when ``platform`` (a
    # :class:`runtime.platforms.Platform`) cannot run this config; core calls it when present.
    # Optional: ``gguf_packed_types`` (ggml type ids): a GGUF checkpoint's weights of this config's
    # linear layers whose type is listed arrive as raw blocks, ``qweight_type`` (int64 []) then
    # ``qweight`` (uint8 [out, bytes per row]); other types arrive the same way dequantized
    # (type 0, F32, float32 [out, in]) with a log line naming the tensor.


@runtime_checkable
class QuantMethod(Protocol):
    """A quantization scheme (``fp8``, ``int8``, ``gptq``, ``awq`` ...), registered by name."""

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> QuantConfig:
        """Build the config from the checkpoint's ``quantization_config`` (None for online
        quantization of an unquantized checkpoint). ``model_config`` is the engine's
        :class:`runtime.config.ModelConfig`. Raise ValueError for settings the method cannot run."""

    # Optional: ``packs_gguf_by_default(gguf_file, dtype, platform, tensor_parallel_size,
    # pipeline_parallel_size) -> str | None``: a reason to load a GGUF file through this method
    # when no ``--quantization`` is given (None: dequantize at load); see default_gguf_method.
    # Optional: ``supports_tensor_parallel = True``: its linear methods load each rank's part of a
    # checkpoint tensor through ``layer.rank_part(tensor, shard, out_dim, out_unit, in_dim, in_unit)``
    # (:meth:`runtime.models.linear.Linear.rank_part`), so layers may be split over ranks. Without
    # it, tensor_parallel_size > 1 is refused for the method.


def supports_tensor_parallel(name: str) -> bool:
    """Whether quant method ``name`` splits its layers over tensor-parallel ranks."""
    from runtime.plugins import get_registry

    return bool(getattr(get_registry("quant_method").create(name), "supports_tensor_parallel", False))


def detect_quant_method(quantization_config: dict[str, Any] | None) -> str | None:
    """The method a Hugging Face ``quantization_config`` names (its ``quant_method``), if any."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    return str(method) if method else None


def hf_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config as a plain dict, if it has one."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


def _claimed_by(registry: Any, quantization_config: dict[str, Any]) -> str | None:
    """The registered method whose ``detect`` claims the checkpoint, else the one named like it."""
    named = detect_quant_method(quantization_config)
    for component in registry:
        detect = component.options.get("detect")
        if detect is not None and detect(quantization_config):
            return component.name
    return named if named in registry else None


def select_quant_method(requested: str | None, hf_config: Any) -> str | None:
    """The quant method to load with: ``requested`` (``--quantization``), else the checkpoint's.

    A checkpoint whose ``quantization_config`` names a method nothing installed handles (or none), or a
    ``requested`` method that differs from the checkpoint's, is a ValueError naming the
    installed methods.
    """
    from runtime.plugins import get_registry

    registry = get_registry("quant_method")
    quantization_config = hf_quantization_config(hf_config)
    named = detect_quant_method(quantization_config)
    claimed = _claimed_by(registry, quantization_config) if quantization_config else None
    installed = ", ".join(sorted(registry.names())) or "none (pip install -e plugins/quant)"
    if requested is not None and requested not in registry:
        raise ValueError("--quantization: " + registry.unknown_message(requested))
    if quantization_config and named is None and claimed is None:
        raise ValueError(
            f"the checkpoint's quantization_config (keys: {', '.join(sorted(quantization_config))}) names no "
            f"quant_method, so its quantized tensors cannot be read; set quantization_config.quant_method to one "
            f"of the installed quant methods: {installed}"
        )
    if named is not None and claimed is None:
        raise ValueError(
            f"the checkpoint's quantization_config.quant_method {named!r} is not supported; "
            f"installed quant methods: {installed}"
        )
    if requested is not None and claimed is not None and requested != claimed:
        raise ValueError(
            f"--quantization {requested!r} does not match the checkpoint, which is quantized with "
            f"{named!r} (quant method {claimed!r}); leave --quantization unset to use it"
        )
    return requested if requested is not None else claimed


GGUF_DEQUANTIZE_ENV = "RUNTIME_GGUF_DEQUANTIZE"

# vLLM's names of its kernel variants of a method (``--quantization gptq_marlin``): here that
# method, whose kernels are chosen per layer and device.
VLLM_KERNEL_NAMES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


def canonical_quant_method(name: str | None) -> str | None:
    """``--quantization``'s value with vLLM's kernel-variant names (``gptq_marlin``, ``awq_marlin``)
    read as their method (``gptq``, ``awq``), logged once; other names unchanged."""
    if name not in VLLM_KERNEL_NAMES:
        return name
    logger.info("--quantization %s: vLLM's %s kernels; here %s, which picks its kernels per layer and device",
                name, name.partition("_")[2].capitalize(), VLLM_KERNEL_NAMES[name])
    return VLLM_KERNEL_NAMES[name]


def default_gguf_method(gguf_file: str, dtype: torch.dtype, platform: Any, tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1) -> tuple[str, str] | None:
    """(method, why) when an installed quant method should keep a GGUF file's weights packed
    without ``--quantization``: a method's optional ``packs_gguf_by_default(gguf_file, dtype,
    platform, tensor_parallel_size, pipeline_parallel_size)`` answers with its reason (None: no).
    ``RUNTIME_GGUF_DEQUANTIZE=1`` keeps dequantize-at-load."""
    if os.environ.get(GGUF_DEQUANTIZE_ENV) == "1":
        return None
    from runtime.plugins import get_registry

    registry = get_registry("quant_method")
    for name in sorted(registry.names()):
        method = registry.create(name)
        prefers = getattr(method, "packs_gguf_by_default", None)
        why = prefers(gguf_file, dtype, platform, tensor_parallel_size, pipeline_parallel_size) if prefers else None
        if why:
            return name, why
    return None


def build_quant_config(model_config: Any, platform: Any = None) -> QuantConfig | None:
    """The :class:`QuantConfig` for ``model_config.quantization`` (None: unquantized).

    The checkpoint's ``quantization_config`` goes to the method (None when the checkpoint has
    none: online quantization); the config's optional ``verify_platform`` checks ``platform``.
    """
    name = getattr(model_config, "quantization", None)
    if name is None:
        return None
    from runtime.plugins import get_registry

    method = get_registry("quant_method").create(name)
    config = method.get_config(hf_quantization_config(model_config.hf_config), model_config)
    verify = getattr(config, "verify_platform", None)
    if platform is not None and verify is not None:
        verify(platform)
    return config
