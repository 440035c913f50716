"""The weight-only 4/8-bit kernels of runtime_quant.wna16_kernels against its reference.

Layers in the canonical packed layout are built from random codes, scales and zero points;
every CPU kernel (torch's int4 tiles, int8 rows, the sliced dequantize-and-matmul) and the
Triton GEMV / GEMM (under Triton's interpreter on the CPU, compiled on a GPU) must give the
reference's ``x @ ((q - z) * s)``. Shapes are small and uneven: a K tail shorter than a
block, N not a multiple of the column block, groups of 16 .. 64 rows or one group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime_quant.packing import AWQ_ORDER, awq_to_sequential, pack, sequential_to_awq, unpack
from runtime_quant.wna16_kernels import KERNELS, BoundKernel, dequant_matmul, select_wna16_kernel
from runtime_quant.wna16_scheme import WNA16Scheme


def make_layer(bits: int, group: int, in_features: int, out_features: int, device="cpu", seed: int = 0,
               dtype=torch.float32) -> tuple[nn.Module, WNA16Scheme]:
    gen = torch.Generator().manual_seed(seed)
    scheme = WNA16Scheme("gptq", bits, group, symmetric=False)
    groups = scheme.groups(in_features)
    layer = nn.Module()
    layer.in_features = in_features
    layer.quant_params_dtype = dtype
    layer.quant_group_rows = scheme.rows_per_group(in_features)
    layer.quant_bits = scheme.bits
    codes = torch.randint(0, 1 << bits, (in_features, out_features), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 1 << bits, (groups, out_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(groups, out_features, generator=gen) * 0.02 + 0.001
    for name, t in (("qweight", pack(codes, bits, dim=0)), ("scales", scales), ("zeros", zeros)):
        setattr(layer, name, nn.Parameter(t.to(device), requires_grad=False))
    return layer, scheme


def kernel(name: str) -> object:
    return next(k for k in KERNELS if k.name == name)


def test_packing_round_trips_and_awq_order():
    codes = torch.randint(0, 16, (24, 16), dtype=torch.uint8)
    for dim in (0, 1):
        assert torch.equal(unpack(pack(codes, 4, dim), 4, dim), codes)
    assert torch.equal(unpack(pack(codes, 8, 1), 8, 1), codes)
    word = pack(torch.arange(8, dtype=torch.uint8)[None], 4, 1)  # codes 0..7, slot j holds code j
    assert word.item() == 0x76543210
    assert sequential_to_awq(torch.arange(8)[None]).tolist() == [list(AWQ_ORDER)]
    assert torch.equal(awq_to_sequential(sequential_to_awq(codes)), codes)


@pytest.mark.parametrize("bits,group,name,dtype", [
    (4, 32, "int4pack_mm", torch.bfloat16), (4, 64, "int4pack_mm", torch.bfloat16), (4, 64, "int4pack_mm", torch.float32),
    (8, -1, "int8pack_mm", torch.float32), (8, -1, "int8pack_mm", torch.bfloat16),
    (4, 16, "sliced_matmul", torch.float32), (4, 64, "sliced_matmul", torch.bfloat16),
    (8, 32, "sliced_matmul", torch.float32), (4, -1, "sliced_matmul", torch.float32),
])
def test_cpu_kernels(bits, group, name, dtype):
    in_features, out_features = 2112, 80  # 4-bit: two halves of 1056 rows, two slices each (one short)
    layer, scheme = make_layer(bits, group, in_features, out_features, dtype=dtype)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    expected = dequant_matmul(layer, scheme, x.to(dtype).float(), bias)
    bound = BoundKernel(kernel(name), scheme)
    bound.prepare(layer)
    assert not hasattr(layer, "qweight") or name == "dequant_matmul"  # repacked, still packed
    out = bound.run(layer, x.to(dtype), bias.to(dtype))
    assert out.dtype == dtype and out.shape == (5, out_features)
    tol = 1e-4 if dtype == torch.float32 else 0.02 * expected.abs().max().item()  # bf16 weights and sums
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=1e-2 if dtype != torch.float32 else 1e-5)


def test_cpu_kernel_selection():
    def selected(bits, group, out_features, dtype):
        layer, scheme = make_layer(bits, group, 64, out_features, dtype=dtype)
        return select_wna16_kernel(scheme, layer).name

    assert selected(4, 32, 32, torch.bfloat16) == "int4pack_mm"
    assert selected(4, 32, 32, torch.float32) == "sliced_matmul"  # torch's float32 int4 kernel is slow
    assert selected(4, 16, 32, torch.bfloat16) == "sliced_matmul"  # int4 tiles take groups of 32 .. 256
    assert selected(4, 32, 40, torch.bfloat16) == "sliced_matmul"  # ... and outputs in tiles of 16
    assert selected(8, -1, 32, torch.float32) == "int8pack_mm"
    assert selected(8, 32, 32, torch.float32) == "sliced_matmul"


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 64), (4, -1)])
@pytest.mark.parametrize("rows", [1, 3, 5, 33])  # GEMV (<= 4 rows, split along K), then the tl.dot GEMM
def test_triton_kernels(kernel_device, bits, group, rows):
    pytest.importorskip("triton")
    from runtime_quant import wna16_gpu

    in_features, out_features = 200, 72  # K tail of 8 rows past the last 64/128-row block
    layer, scheme = make_layer(bits, group, in_features, out_features, kernel_device, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(out_features)
    cpu_layer, _ = make_layer(bits, group, in_features, out_features, seed=rows)
    expected = dequant_matmul(cpu_layer, scheme, x, bias)
    out = wna16_gpu.triton_wna16(layer, scheme, x.to(kernel_device), bias.to(kernel_device))
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-3, rtol=1e-4)


def test_triton_gemm_bf16(kernel_device):
    pytest.importorskip("triton")
    from runtime_quant import wna16_gpu

    layer, scheme = make_layer(4, 32, 128, 64, kernel_device)
    cpu_layer, _ = make_layer(4, 32, 128, 64)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = wna16_gpu.wna16_gemm(layer, 4, x.to(kernel_device), None)
    expected = dequant_matmul(cpu_layer, scheme, x.float(), None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected, atol=0.05 * expected.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, -1)])
def test_triton_dequantize_then_matmul_for_large_batches(kernel_device, bits, group, monkeypatch):
    """From DEQUANT_MIN_ROWS rows the layer is dequantized into the one-layer scratch (W.T exactly the
    reference's weights) and multiplied by torch; fewer rows keep the fused GEMM."""
    pytest.importorskip("triton")
    from runtime_quant import wna16_gpu

    layer, scheme = make_layer(bits, group, 200, 72, kernel_device, seed=7)
    cpu_layer, _ = make_layer(bits, group, 200, 72, seed=7)
    dense_t = dequant_matmul(cpu_layer, scheme, torch.eye(200), None)  # W.T, [K, N]
    assert torch.equal(wna16_gpu.wna16_dequantize_gpu(layer, bits, torch.float32).cpu(), dense_t)
    fused, calls = wna16_gpu.wna16_gemm, []
    monkeypatch.setattr(wna16_gpu, "wna16_gemm", lambda layer, bits, x, bias: calls.append(len(x)) or fused(layer, bits, x, bias))
    for rows in (wna16_gpu.DEQUANT_MIN_ROWS - 1, wna16_gpu.DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
        bias = torch.randn(72)
        out = wna16_gpu.triton_wna16(layer, scheme, x.to(kernel_device), bias.to(kernel_device))
        torch.testing.assert_close(out.cpu(), dequant_matmul(cpu_layer, scheme, x, bias), atol=1e-3, rtol=1e-4)
    assert calls == [wna16_gpu.DEQUANT_MIN_ROWS - 1]  # only the smaller batch ran the fused GEMM


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
                         ids=["qkv", "o", "gate_up", "down"])  # Llama-3-8B's linear layers
@pytest.mark.parametrize("rows", [1, 4, 64, 512])
def test_triton_kernels_on_8b_shapes(shape, rows):
    layer, scheme = make_layer(4, 128, *shape, device="cuda")
    assert select_wna16_kernel(scheme, layer).name == "triton_wna16"
    x = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    from runtime_quant import wna16_gpu

    out = wna16_gpu.triton_wna16(layer, scheme, x.cuda(), None).float()
    expected = dequant_matmul(layer, scheme, x.cuda().float(), None)
    torch.testing.assert_close(out, expected, atol=0.02 * expected.abs().max().item(), rtol=2e-2)
    if rows == 1:  # that was the CUDA GEMV; the Triton one stays the fallback (no CuPy)
        config = wna16_gpu.gemv_config(shape[1], shape[0], layer.quant_group_rows, torch.device("cuda"))
        triton_out = wna16_gpu.wna16_gemv(layer, 4, x.cuda(), None, config).float()
        torch.testing.assert_close(triton_out, expected, atol=0.02 * expected.abs().max().item(), rtol=2e-2)
