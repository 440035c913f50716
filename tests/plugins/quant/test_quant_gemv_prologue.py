"""Which quantized layers take a norm or activation fused into their one-row gemv.

Only a layer whose batch-1 step is runtime-kernels' gemv with row scales (the fp8 method's
``fp8_scaled_mm`` kernel, bf16 rows) opts in (``W8A8LinearMethod.gemv_weights``); every other
kernel and method (int8, GGUF, GPTQ/AWQ) keeps the unfused path. A tiny Llama quantized to FP8
on load, with that kernel (the GPU's choice; the CPU would pick the reference), gives with the
fused kernels (Triton's under the interpreter, the CUDA GEMV's on a GPU) the logits of the unfused ones
on batch-1 steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.counting import counted
from support.paged_batch import PagedRunner

from runtime.model_loader import load_model, resolve_model
from runtime.models.layers import MergedLinear
from runtime.models.ops import custom_ops_scope
from runtime.models.quantize import quantized_layers
from runtime.quantization import build_quant_config
from runtime_quant.gguf import GgufLinearMethod
from runtime_quant.kernels import KERNELS
from runtime_quant.linear import W8A8LinearMethod
from runtime_quant.scheme import FP8, INT8, W8A8Scheme
from runtime_quant.wna16_linear import WNA16LinearMethod

pytest.importorskip("triton")

FP8_SCALED_MM = next(kernel for kernel in KERNELS if kernel.name == "fp8_scaled_mm")
FP8_CHANNEL = W8A8Scheme(FP8, "channel", activations="token")


def fp8_layer(sizes: dict[str, int], in_features: int, kernel) -> MergedLinear:
    with custom_ops_scope({"gemv": lambda *args: None}):
        layer = MergedLinear(in_features, sizes, bias=True)
    del layer.weight
    layer.quant_method = W8A8LinearMethod(FP8_CHANNEL)
    layer.quant_method.create_weights(layer, in_features, list(sizes.values()), torch.bfloat16)
    layer.weight_scale = torch.nn.Parameter(torch.rand(sum(sizes.values())), requires_grad=False)  # as processed: [out]
    layer.quant_kernel = kernel
    return layer


def test_only_the_fp8_gemv_path_opts_in():
    layer = fp8_layer({"gate": 32, "up": 32}, 48, FP8_SCALED_MM)
    row = torch.zeros(1, 48, dtype=torch.bfloat16)
    weight, bias, scale = layer.gemv_operands(row)
    assert weight is layer.weight and bias is layer.bias and scale is layer.weight_scale
    assert layer.gemv_operands(torch.zeros(2, 48, dtype=torch.bfloat16)) is None  # cuBLASLt's batch path
    assert layer.gemv_operands(row.half()) is None  # fp8_scaled_mm takes bf16 only: the reference runs
    assert fp8_layer({"gate": 20, "up": 20}, 48, FP8_SCALED_MM).gemv_operands(row) is None  # 40 rows: not a multiple of 16
    for kernel in KERNELS:
        if kernel is not FP8_SCALED_MM:  # int8 and block-wise FP8 GEMMs, torch._int_mm, the reference
            assert fp8_layer({"gate": 32, "up": 32}, 48, kernel).gemv_operands(row) is None, kernel.name
    for method in (GgufLinearMethod, WNA16LinearMethod):  # GGUF, GPTQ/AWQ: their own one-row kernels
        assert not hasattr(method, "gemv_weights"), method.__name__


def test_int8_never_selects_the_fp8_kernel():
    scheme = W8A8Scheme(INT8, "channel", activations="token")
    assert not any(k.gemv_weights is not None and k.supports(scheme, torch.device("cuda")) for k in KERNELS)


def kernel_ops() -> dict:
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.gemv import gemv, rms_norm_gemv, silu_and_mul_gemv
    from runtime_kernels.norm import fused_add_rms_norm, rms_norm

    return {"gemv": gemv, "rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, "silu_and_mul": silu_and_mul,
            "rms_norm_gemv": rms_norm_gemv, "silu_and_mul_gemv": silu_and_mul_gemv}


def fp8_model(path: str, ops: dict, device: str):
    resolved = resolve_model(path)
    config = build_quant_config(SimpleNamespace(quantization="fp8", hf_config=resolved.hf_config))
    with custom_ops_scope(ops):
        model = load_model(resolved, dtype=torch.bfloat16, device=device, quant_config=config)
    layers = quantized_layers(model)
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down of each layer; lm_head stays bf16
    for layer in layers.values():
        layer.quant_kernel = FP8_SCALED_MM
    return model


def test_fp8_model_fuses_on_batch_1_steps(float_checkpoint, kernel_device, monkeypatch):
    """One-token steps only (the kernel's batch path is cuBLASLt's, which needs a GPU). The norm before
    q/k/v goes through ``rms_norm_gemv``, and the norm, gate/up and SiLU through ``rms_norm_gemv`` with
    ``gated``, so down is a plain gemv and ``silu_and_mul_gemv`` is not called; on a GPU the 8-bit layers
    take the norm as a launch of its own unless the CUDA GEMV runs them (``RUNTIME_GEMV_CUDA=1``), which
    the op decides. Logits equal to the unfused ops' either way."""
    from runtime_kernels import gemv_cuda

    ops = kernel_ops()
    for cuda_gemv in ((False, True) if kernel_device == "cuda" else (False,)):
        monkeypatch.setattr(gemv_cuda, "ENABLED", cuda_gemv)
        calls = {}
        unfused = fp8_model(float_checkpoint, {n: op for n, op in ops.items() if not n.endswith("_gemv")}, kernel_device)
        fused = fp8_model(float_checkpoint, counted(ops, calls), kernel_device)
        runners = [PagedRunner(model, num_requests=1, block_size=4, seed=3) for model in (unfused, fused)]
        for tokens in ([5], [42], [7]):
            want, have = (torch.cat(runner.step([tokens])).float().cpu() for runner in runners)
            assert want.abs().max() > 1, "logits too small for the comparison to mean much"
            torch.testing.assert_close(have, want, atol=0.05, rtol=0.02)
        # 3 steps, 2 layers, each with the norm before q/k/v and the one before gate/up
        assert calls["rms_norm_gemv"] == 3 * 2 * 2 and "silu_and_mul_gemv" not in calls, calls
