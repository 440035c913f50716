"""One fused linear layer through ``W8A8LinearMethod``: projections of uneven sizes, partial
blocks, per-projection scales, against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import FP8, block_amax, expand_blocks, fake_quant, to_codes

from runtime.models.layers import MergedLinear
from runtime_quant.kernels import select_kernel
from runtime_quant.linear import W8A8LinearMethod
from runtime_quant.scheme import INT8, W8A8Scheme

SIZES = {"q": 24, "k": 40}  # neither a multiple of the 16-row blocks below
IN = 48  # one and a half 32-column blocks


def fused_layer(scheme: W8A8Scheme) -> MergedLinear:
    layer = MergedLinear(IN, SIZES, bias=True)
    del layer.weight
    layer.quant_method = W8A8LinearMethod(scheme)
    layer.quant_method.create_weights(layer, IN, list(SIZES.values()), torch.float32)
    layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("scheme", [
    W8A8Scheme(FP8, "block", activations="group", block_size=(16, 32), weight_scale_name="weight_scale_inv"),
    W8A8Scheme(FP8, "tensor", activations="tensor", static_activations=True),
    W8A8Scheme(INT8, "channel", activations="token"),
    W8A8Scheme(INT8, "channel", activations="tensor", static_activations=True),
    W8A8Scheme(FP8, "channel", activations=None),
], ids=["fp8-block", "fp8-tensor-static", "int8-channel", "int8-tensor-static", "fp8-weight-only"])
def test_fused_layer_matches_the_reference(scheme):
    torch.manual_seed(0)
    layer = fused_layer(scheme)
    x = torch.randn(5, IN)
    weights, input_scale = [], torch.tensor(0.02)
    for shard, rows in enumerate(SIZES.values()):
        w = torch.randn(rows, IN)
        if scheme.weight_strategy == "block":
            scale = block_amax(w, list(scheme.block_size)) / 448
            full = expand_blocks(scale, w.shape, list(scheme.block_size))
        elif scheme.weight_strategy == "tensor":
            scale = full = w.abs().max() / 448 * (shard + 1)  # each projection its own scale
        else:
            scale = full = w.abs().amax(1, keepdim=True) / (448 if scheme.weight_dtype == FP8 else 127)
        codes = to_codes(w, full, scheme.weight_dtype)
        weights.append(codes.float() * full)
        layer.quant_method.load(layer, "weight", codes, shard)
        layer.quant_method.load(layer, scheme.weight_scale_name, scale, shard)
        if scheme.static_activations:
            layer.quant_method.load(layer, "input_scale", input_scale * (shard + 1), shard)
    layer.quant_method.process_weights_after_loading(layer)
    if scheme.activations is None:
        x_ref = x
    else:  # static: one input feeds both projections, quantized with the larger scale
        x_ref = fake_quant(x, scheme.activations, scheme.weight_dtype, input_scale * 2, (scheme.block_size or (0, 0))[1])
    expected = x_ref @ torch.cat(weights).t() + layer.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    assert layer.quant_kernel == select_kernel(scheme, x.device)
    assert not hasattr(layer, "weight_scale_inv")


def test_int8_uses_int_mm_on_the_cpu():
    assert select_kernel(W8A8Scheme(INT8, "channel", activations="token"), torch.device("cpu")).name == "int_mm"
    assert select_kernel(W8A8Scheme(FP8, "channel", activations="token"), torch.device("cpu")).name == "dequant_matmul"


def test_static_int8_activations_saturate_at_the_types_range():
    from runtime_quant.kernels import quantize

    x = torch.tensor([-1.30, -1.276, -1.27, 1.27, 1.276, 1.30])
    # -128 is a code (vLLM's static int8 kernel and compressed-tensors saturate at -128, not -127)
    assert quantize(x, torch.tensor(0.01), INT8).tolist() == [-128, -128, -127, 127, 127, 127]
