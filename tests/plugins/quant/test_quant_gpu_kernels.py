"""The GPU GEMMs of runtime_quant.gpu against the dequantize-then-matmul reference.

The Triton GEMM runs under Triton's interpreter on the CPU (the root conftest chooses) and
compiled on a GPU; ``torch._scaled_mm`` and kernel selection need a GPU (``gpu`` marker).
Both sides quantize the activations the same way, so they differ only by summation order
and the bf16 output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from runtime_kernels.gemv import gemv  # noqa: E402
from runtime_quant import gpu  # noqa: E402
from runtime_quant.kernels import dequant_matmul, select_kernel  # noqa: E402
from runtime_quant.scheme import FP8, INT8, W8A8Scheme, quant_max  # noqa: E402

INT8_ROWS = W8A8Scheme(INT8, "channel", "token")
FP8_BLOCKS = W8A8Scheme(FP8, "block", "group", block_size=(128, 128))
FP8_CHANNEL = W8A8Scheme(FP8, "channel", "token")
FP8_STATIC = W8A8Scheme(FP8, "tensor", "tensor", static_activations=True)


def make_layer(scheme: W8A8Scheme, out_features: int, in_features: int, device: str, seed: int = 0) -> nn.Module:
    """A layer in the canonical layout of runtime_quant.kernels, from random real weights."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    layer = nn.Module()
    qmax = quant_max(scheme.weight_dtype)
    if scheme.weight_strategy == "block":
        rows, cols = scheme.block_size
        blocks = nn.functional.pad(w, (0, -in_features % cols, 0, -out_features % rows))
        blocks = blocks.view(blocks.shape[0] // rows, rows, -1, cols)
        block_scale = blocks.abs().amax(dim=(1, 3)) / qmax  # [row blocks, col blocks]
        scale = block_scale.repeat_interleave(rows, dim=0)[:out_features]  # [out, col blocks]
        full = scale.repeat_interleave(cols, dim=1)[:, :in_features]
    else:
        scale = w.abs().amax(dim=1) / qmax  # [out]
        full = scale[:, None]
    q = (w / full).clamp(-qmax, qmax)
    layer.weight = nn.Parameter((q.round() if scheme.weight_dtype == INT8 else q).to(scheme.weight_dtype).to(device),
                                requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float().contiguous().to(device), requires_grad=False)
    if scheme.static_activations:
        layer.input_scale = nn.Parameter(torch.tensor(0.02, device=device), requires_grad=False)
    return layer


def reference(layer, scheme, x, bias):
    """The reference on the CPU in float32 (the interpreter and the GPU give the same inputs)."""
    cpu = nn.Module()
    for name, p in layer.named_parameters():
        setattr(cpu, name, nn.Parameter(p.detach().cpu(), requires_grad=False))
    return dequant_matmul(cpu, scheme, x.float().cpu(), None if bias is None else bias.float().cpu())


@pytest.mark.parametrize("scheme", [INT8_ROWS, FP8_BLOCKS], ids=["int8_rows", "fp8_blocks"])
@pytest.mark.parametrize("rows", [1, 5, 40, 130])
def test_triton_scaled_gemm(kernel_device, scheme, rows):
    layer = make_layer(scheme, 200, 320, kernel_device)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(200).to(torch.bfloat16)
    out = gpu.triton_scaled_gemm(layer, scheme, x.to(kernel_device), bias.to(kernel_device))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    # The GEMM on the codes and scales the kernel was given: a scale computed on another
    # device may differ in its last bit (CUDA divides by a scalar through its reciprocal) and
    # flip one activation code, a whole code step in the output. Quantization is tested apart.
    if scheme.weight_strategy == "block":
        codes, scales = gpu._group_quantize(x.to(kernel_device), FP8, 128)
        scales = scales.cpu().repeat_interleave(128, dim=1)[:, :320]
    else:
        codes, scales = gpu._row_quantize(x.to(kernel_device), INT8)
        scales = scales.cpu()
    x_real = codes.cpu().double() * scales.double()
    weight = layer.weight.cpu().double() * (
        layer.weight_scale.cpu().double().repeat_interleave(128, dim=1)[:, :320]
        if scheme.weight_strategy == "block" else layer.weight_scale.cpu().double()[:, None]
    )
    expected = x_real @ weight.t() + bias.double()
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-2, rtol=1e-2)
    # and, on average, within bf16 rounding (outputs of 1-4: steps of 0.008-0.016) of the reference, which quantizes on the CPU
    ref = reference(layer, scheme, x, bias).double()
    assert (out.double().cpu() - ref).abs().mean() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [FP8_CHANNEL, FP8_STATIC], ids=["fp8_channel_token", "fp8_tensor_static"])
@pytest.mark.parametrize("rows", [1, 17, 256])
def test_fp8_scaled_mm(scheme, rows):
    layer = make_layer(scheme, 256, 512, "cuda")
    assert select_kernel(scheme, torch.device("cuda")).name == "fp8_scaled_mm"
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = gpu.fp8_scaled_mm(layer, scheme, x.cuda(), None)
    # one row: weight-only (fp8_gemv), activations not quantized
    expected = weight_only_reference(layer, x, None) if rows == 1 else reference(layer, scheme, x, None).float()
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fp8_scaled_mm_accumulates_a_long_k_within_bounds():
    """Fast accumulation (the default) over Llama-3.1-8B's down projection's K = 14,336: against the float64 product
    of the same codes, the error is within 1 % of the outputs' size on average (H200, 2026-11-29: 0.28 %; with
    the precise accumulation 0.14 %, the bf16 output's rounding)."""
    scheme = FP8_CHANNEL
    layer = make_layer(scheme, 256, 14336, "cuda")
    x = torch.randn(512, 14336, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    out = gpu.fp8_scaled_mm(layer, scheme, x, None).double().cpu()
    codes, scale_a = gpu._row_quantize(x, FP8)
    weight = layer.weight.float().double() * layer.weight_scale.double()[:, None]
    exact = ((codes.float().double() * scale_a.double()) @ weight.t()).cpu()
    assert ((out - exact).abs().mean() / exact.abs().mean()).item() < 0.01


def weight_only_reference(layer, x, bias):
    """``x`` (not quantized) times the dequantized per-row FP8 weight, float64 on the CPU."""
    weight = layer.weight.cpu().double() * layer.weight_scale.cpu().double()[:, None]
    out = x.double().cpu() @ weight.t()
    return (out if bias is None else out + bias.double().cpu()).float()


@pytest.mark.parametrize("shape", [(37, 200), (256, 512), (8, 1030)])
def test_fp8_gemv_is_the_dequantized_weight_times_the_row(kernel_device, shape):
    """The batch-1 FP8 path (runtime-kernels' gemv with row scales): any N (partial row tiles), K not a multiple of the slice, bias or not."""
    n, k = shape
    layer = make_layer(FP8_CHANNEL, n, k, kernel_device, seed=n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    for bias in (None, torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)):
        out = gemv(x.to(kernel_device), layer.weight, None if bias is None else bias.to(kernel_device), scale=layer.weight_scale)
        assert out.dtype == torch.bfloat16 and out.shape == (1, n)
        expected = weight_only_reference(layer, x, bias)
        # float32 accumulation in a different order, then one bf16 rounding (outputs of ~1: steps of 0.008)
        torch.testing.assert_close(out.float().cpu(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_kernel_selection():
    cuda = torch.device("cuda")
    assert select_kernel(INT8_ROWS, cuda).name == "triton_scaled_gemm"
    assert select_kernel(FP8_BLOCKS, cuda).name == "triton_scaled_gemm"
    assert select_kernel(FP8_CHANNEL, torch.device("cpu")).name == "dequant_matmul"


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_row_quantize_matches_torch(kernel_device, dtype, static):
    """One launch per activation matrix: the same codes and scales as runtime_quant.kernels' torch ops."""
    from runtime_quant.kernels import quantize, row_scales

    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 3
    x[2] = 0.0  # an all-zero row takes the minimum scale
    x[3, :4] = torch.tensor([0.5, 1.5, -2.5, 2.5]) * (x[3].abs().max() / quant_max(dtype))  # ties
    static_scale = torch.tensor([0.05]) if static else None
    codes, scales = gpu._row_quantize(x.to(kernel_device), dtype, None if static_scale is None else static_scale.to(kernel_device))
    expected_scales = static_scale.expand(7, 1) if static else row_scales(x, dtype)
    torch.testing.assert_close(scales.cpu(), expected_scales, atol=0, rtol=0)
    torch.testing.assert_close(codes.cpu().float(), quantize(x, expected_scales, dtype).float(), atol=0, rtol=0)


@pytest.mark.parametrize("hidden", [4096, 1000])
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_quantize_is_the_norm_then_the_quantization(kernel_device, hidden, with_residual, gemma):
    """The RMSNorm that quantizes its rows for the FP8 layer after it gives, bit for bit, the codes and scales of
    runtime-kernels' norm followed by the row quantizer, and the same x + residual."""
    from runtime_kernels.norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(hidden + with_residual + 2 * gemma)
    x = (torch.randn(5, hidden, generator=g) * 4).to(torch.bfloat16).to(kernel_device)
    x[1] = 0.0  # a row of zeros: the minimum scale
    residual = torch.randn(5, hidden, generator=g).to(torch.bfloat16).to(kernel_device) if with_residual else None
    weight = (torch.randn(hidden, generator=g) * 0.2 + (0.0 if gemma else 1.0)).to(torch.bfloat16).to(kernel_device)
    inputs = [t.clone() for t in (x, residual) if t is not None]
    codes, scales, summed = gpu.rms_norm_quantize(x, residual, weight, 1e-6, gemma)
    if residual is None:
        normed, expected_summed = rms_norm(x, weight, 1e-6, gemma=gemma), x
    else:
        normed, expected_summed = fused_add_rms_norm(*[t.clone() for t in (x, residual)], weight, 1e-6, gemma=gemma)
    expected_codes, expected_scales = gpu._row_quantize(normed, FP8)
    assert codes.dtype == FP8 and codes.shape == (5, hidden) and scales.shape == (5, 1)
    assert torch.equal(scales, expected_scales) and torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert torch.equal(summed, expected_summed) and (residual is not None or summed is x)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (t for t in (x, residual) if t is not None)))


@pytest.mark.parametrize("d", [14336, 1000])
def test_silu_and_mul_quantize_is_the_activation_then_the_quantization(kernel_device, d):
    from runtime_kernels.activation import silu_and_mul

    x = (torch.randn(3, 2 * d, generator=torch.Generator().manual_seed(d)) * 3).to(torch.bfloat16).to(kernel_device)
    codes, scales = gpu.silu_and_mul_quantize(x)
    expected_codes, expected_scales = gpu._row_quantize(silu_and_mul(x), FP8)
    assert codes.dtype == FP8 and codes.shape == (3, d)
    assert torch.equal(scales, expected_scales) and torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 37])
def test_fp8_layers_take_the_op_before_them_with_the_quantization(rows, monkeypatch):
    """An FP8 per-token layer of 2+ rows runs the RMSNorm (or SiLU-and-mul) before it and the quantization in
    one launch: exactly fp8_scaled_mm of the separate op's output; one row (the gemv) and static scales decline."""
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.norm import fused_add_rms_norm

    monkeypatch.setattr(gpu, "FUSED_QUANT", True)  # the default
    layer = make_layer(FP8_CHANNEL, 256, 512, "cuda")
    kernel = select_kernel(FP8_CHANNEL, torch.device("cuda"))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16).cuda()
    residual = torch.randn(rows, 512, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(512, generator=g) * 0.1 + 1).to(torch.bfloat16).cuda()
    bias = torch.randn(256, generator=g).to(torch.bfloat16).cuda()
    fused = kernel.after_rms_norm(layer, FP8_CHANNEL, x, residual, weight, 1e-6, False, bias)
    gate_up = torch.randn(rows, 1024, generator=g).to(torch.bfloat16).cuda()
    fused_silu = kernel.after_silu_and_mul(layer, FP8_CHANNEL, gate_up, bias)
    if rows == 1:
        assert fused is None and fused_silu is None
        return
    normed, summed = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(fused[0], gpu.fp8_scaled_mm(layer, FP8_CHANNEL, normed, bias)) and torch.equal(fused[1], summed)
    assert torch.equal(fused_silu, gpu.fp8_scaled_mm(layer, FP8_CHANNEL, silu_and_mul(gate_up), bias))
    static = make_layer(FP8_STATIC, 256, 512, "cuda")
    assert kernel.after_rms_norm(static, FP8_STATIC, x, residual, weight, 1e-6, False, None) is None
    monkeypatch.setattr(gpu, "FUSED_QUANT", False)  # RUNTIME_FP8_FUSED_QUANT=0: the ops apart
    assert kernel.after_rms_norm(layer, FP8_CHANNEL, x, residual, weight, 1e-6, False, bias) is None
