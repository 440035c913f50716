"""``awq``: checkpoints written by AutoAWQ / llm-awq (``quant_method: awq``, GEMM version).

Tensors per linear layer: ``qweight`` int32 [in, out / 8] and ``qzeros`` int32
[groups, out / 8], eight 4-bit codes per word in AutoAWQ's interleaved column order
(:data:`runtime_quant.packing.AWQ_ORDER`), and ``scales`` float16 [groups, out]; zero
points are stored as they are. Supported: 4 bits with zero points, version ``gemm``, group
sizes -1, 16 ... 256. ``lm_head`` and ``modules_to_not_convert`` stay unquantized.
"""

from __future__ import annotations

from typing import Any

from runtime_quant.gptq import WNA16Config, needs_checkpoint
from runtime_quant.wna16_scheme import WNA16Scheme

VERSIONS = ("gemm",)


def detect(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "awq"


class AwqMethod:
    """:class:`runtime.quantization.QuantMethod` ``awq``."""

    supports_tensor_parallel = True  # its layers load each rank's part (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> WNA16Config:
        config = needs_checkpoint("awq", quantization_config)
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"awq bits {bits!r} is not supported; supported: 4")
        version = str(config.get("version", "gemm")).lower()
        if version not in VERSIONS:
            raise ValueError(f"awq version {version!r} is not supported; supported: {', '.join(VERSIONS)}")
        if not config.get("zero_point", True):
            raise ValueError("awq zero_point false (symmetric AWQ) is not supported; supported: zero_point true")
        group_size = config.get("group_size", config.get("q_group_size", -1))
        scheme = WNA16Scheme("awq", 4, group_size, symmetric=False)
        return WNA16Config(scheme, tuple(config.get("modules_to_not_convert") or ()))
