"""runtime-plugin-quant: 8-bit weight (and activation) and 4/8-bit weight-only quantization.

Methods, registered through ``register_quant_methods``:

- ``fp8``: ``--quantization fp8`` quantizes a 16/32-bit checkpoint on load (per-channel
  weights, dynamic per-token activations); checkpoints with ``quant_method: fp8`` load
  as they are (per-tensor weight scales with static or dynamic activations, or
  ``weight_block_size`` blocks).
- ``int8``: W8A8 on load (per-channel weights, dynamic per-token activations).
- ``compressed-tensors``: checkpoints in its ``float-quantized`` / ``int-quantized`` formats,
  and ``pack-quantized`` (4/8-bit weights only).
- ``gptq`` and ``awq``: 4/8-bit (AWQ: 4-bit) weight-only checkpoints, kept packed in memory.
- ``gguf``: ``--quantization gguf`` keeps a GGUF file's linear weights in llama.cpp's blocks
  (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) instead of dequantizing them at load.

8-bit layers compute through :mod:`runtime_quant.kernels` (a dequantize-then-matmul
reference, ``torch._int_mm`` for int8 on the CPU); weight-only ones through
:mod:`runtime_quant.wna16_kernels` (torch's int4/int8 CPU kernels, Triton on the GPU).
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_quant_methods(register):
    from runtime_quant import awq, compressed_tensors, fp8, gptq

    def fp8_method():
        return fp8.Fp8Method()

    def int8_method():
        from runtime_quant.int8 import Int8Method

        return Int8Method()

    def compressed_tensors_method():
        return compressed_tensors.CompressedTensorsMethod()

    def gptq_method():
        return gptq.GptqMethod()

    def awq_method():
        return awq.AwqMethod()

    register("fp8", fp8_method, detect=fp8.detect)
    register("int8", int8_method)
    register("compressed-tensors", compressed_tensors_method, detect=compressed_tensors.detect)
    register("gptq", gptq_method, detect=gptq.detect)
    register("awq", awq_method, detect=awq.detect)

    def gguf_method():
        from runtime_quant.gguf import GgufMethod

        return GgufMethod()

    register("gguf", gguf_method)
