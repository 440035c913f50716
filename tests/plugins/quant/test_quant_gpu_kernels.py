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
