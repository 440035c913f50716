"""``int8``: W8A8 of a 16/32-bit checkpoint, quantized on load.

Weights get one scale per output channel, activations one per token, both symmetric
(``amax / 127``). ``lm_head`` stays unquantized. Pre-quantized int8 checkpoints are
compressed-tensors checkpoints (``int-quantized``), read by the ``compressed-tensors`` method.
"""

from __future__ import annotations

from typing import Any

from runtime_quant.fp8 import W8A8Config
from runtime_quant.scheme import INT8, W8A8Scheme


class Int8Method:
    """:class:`runtime.quantization.QuantMethod` ``int8``."""

    supports_tensor_parallel = True  # its layers load each rank's part (Linear.rank_part)

    def get_config(self, quantization_config: dict[str, Any] | None, model_config: Any) -> W8A8Config:
        if quantization_config is not None:
            raise ValueError(
                f"int8 quantizes 16/32-bit checkpoints on load; this checkpoint is already quantized "
                f"(quant_method {quantization_config.get('quant_method')!r}); int8 checkpoints load with "
                "the compressed-tensors method"
            )
        return W8A8Config(W8A8Scheme(INT8, "channel", activations="token", online=True))
