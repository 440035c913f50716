"""The ``gguf`` method's kernels against gguf-py's ``dequantize`` (llama.cpp's reference) then a matmul.

Random blocks of every kept type (random bytes, with valid float16 scales): the torch block
decoder must give gguf-py's weights bit for bit; the Triton GEMV (1-4 rows) and GEMM (more),
run by Triton's interpreter on the CPU (small shapes: a few seconds) or compiled on a GPU, and
the CPU parts (torch's int4 tiles, the sliced dequantize) must give ``x @ W.T``. The gpu-marked
test takes the Llama-3.1-8B shapes in bf16 and fp16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime_quant.gguf_blocks import BLOCK_TYPES, BY_NAME, BlockType, dequantize
from runtime_quant.gguf_blocks import random_blocks as blocks
from runtime_quant.gguf_cpu import INT4_MAX_ROWS, Int4Part, SlicedPart, cpu_part

TYPES = [t.name for t in BLOCK_TYPES.values()]
LLAMA_8B_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (in, out)
GPU_SHAPES = [LLAMA_8B_SHAPES[0], LLAMA_8B_SHAPES[3]]


def random_blocks(t: BlockType, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    return blocks(t, rows, in_features, seed).numpy()


def reference(raw: np.ndarray, t: BlockType) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize as gguf_dequantize

    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType(t.ggml)).copy())


@pytest.mark.parametrize("name", TYPES)
def test_block_decoder_matches_gguf_py_bit_for_bit(name):
    t = BY_NAME[name]
    raw = random_blocks(t, 8, 512)
    assert torch.equal(dequantize(torch.from_numpy(raw), t), reference(raw, t))


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rtol: float) -> None:
    """``out`` is ``x @ w.T (+ bias)`` within ``rtol`` of the largest value (the reference in float64:
    no TF32 or summation-order error of its own)."""
    expected = x.double() @ w.to(x.device).double().t() + (0 if bias is None else bias.double())
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("name", TYPES)
def test_triton_gemv_and_gemm(name, kernel_device):
    from runtime_quant.gguf_gpu import gguf_dequant_mm, gguf_gemm, gguf_gemv, gguf_matmul

    t = BY_NAME[name]
    # N not a multiple of the column block; two K splits in the GEMV, the last K step partly past
    # the row (Q*_0: 25 blocks, also in the GEMM)
    n, k = 40, 800 if t.block == 32 else 768
    raw = random_blocks(t, n, k, seed=1)
    w = reference(raw, t)
    qweight = torch.from_numpy(raw).to(kernel_device)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=gen).to(kernel_device)
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=gen).to(kernel_device)
        _check(gguf_gemv(qweight, t, x, bias), x, w, bias, 1e-5)
    x = torch.randn(5, k, generator=gen).to(kernel_device)
    _check(gguf_gemm(qweight, t, x, None), x, w, None, 1e-5)
    out = torch.zeros(5, n + 8, device=kernel_device)  # into a column slice of a wider output
    gguf_matmul(qweight, t, x, None, out[:, 4 : 4 + n])
    _check(out[:, 4 : 4 + n], x, w, None, 1e-5)
    assert out[:, :4].abs().sum() == 0 and out[:, 4 + n :].abs().sum() == 0
    _check(gguf_gemm(qweight, t, x, bias), x, w, bias, 1e-5)  # K split in two, bias in the last split's sum
    # the large-batch path: the layer dequantized into the one-layer scratch, then a matmul
    _check(gguf_dequant_mm(qweight, t, x, bias), x, w, bias, 1e-5)
    out.zero_()
    gguf_dequant_mm(qweight, t, x, bias, out[:, 4 : 4 + n])
    _check(out[:, 4 : 4 + n], x, w, bias, 1e-5)
    assert out[:, :4].abs().sum() == 0 and out[:, 4 + n :].abs().sum() == 0


@pytest.mark.parametrize("name", TYPES)
def test_triton_gemm_weights_are_gguf_py_values(name, kernel_device):
    """The GEMM's dequantized weights bit for bit: float32 rows of the identity give ``W.T`` exactly;
    so does the large-batch path's dequantized layer."""
    from runtime_quant.gguf_gpu import gguf_dequantize_gpu, gguf_gemm

    t = BY_NAME[name]
    raw = random_blocks(t, 40, 512, seed=6)
    qweight = torch.from_numpy(raw).to(kernel_device)
    out = gguf_gemm(qweight, t, torch.eye(512, device=kernel_device), None)
    assert torch.equal(out.t().cpu(), reference(raw, t))
    assert torch.equal(gguf_dequantize_gpu(qweight, t, torch.float32).cpu(), reference(raw, t))


@pytest.mark.parametrize("name", TYPES)
def test_cpu_sliced_part(name):
    t = BY_NAME[name]
    raw = random_blocks(t, 300, 256, seed=3)  # two slices of output rows, one short
    part = cpu_part(torch.from_numpy(raw), t, torch.float32)
    assert isinstance(part, SlicedPart) and part.nbytes() == raw.nbytes  # kept as stored
    x = torch.randn(3, 256)
    out = torch.empty(3, 300)
    part.matmul(x, out)
    _check(out, x, reference(raw, t), None, 1e-5)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS + 3])  # torch's int4 kernel, then the tiles dequantized
def test_cpu_int4_part(name, rows):
    t = BY_NAME[name]
    raw = random_blocks(t, 320, 512, seed=4)
    part = cpu_part(torch.from_numpy(raw), t, torch.bfloat16)
    assert isinstance(part, Int4Part)
    assert part.nbytes() < raw.nbytes * 1.2  # 4-bit codes and a 16-bit scale and offset per 32 inputs
    x = torch.randn(rows, 512).bfloat16()
    out = torch.empty(rows, 320, dtype=torch.bfloat16)
    part.matmul(x, out)
    _check(out, x, reference(raw, t), None, 0.02)  # bf16 scales and sums


def test_16_bit_models_keep_other_types_as_blocks():
    raw = torch.from_numpy(random_blocks(BY_NAME["Q6_K"], 32, 256))
    assert isinstance(cpu_part(raw, BY_NAME["Q6_K"], torch.bfloat16), SlicedPart)
    assert isinstance(cpu_part(torch.from_numpy(random_blocks(BY_NAME["Q4_0"], 24, 256)), BY_NAME["Q4_0"], torch.bfloat16),
                      SlicedPart)  # 24 rows: not whole int4 tiles of 16


# Of the largest value of x @ W.T: 16-bit activations multiply 16-bit weights in the GEMM and the
# output is rounded to the activations' dtype (bf16 keeps 8 bits, fp16 11).
GPU_RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", TYPES)
def test_triton_kernels_on_llama_8b_shapes(name, dtype):
    """Every type's GEMV (1 and 4 rows), fused GEMM (16 rows: one row block split along K; 256 rows) and
    large-batch path (dequantized layer + cuBLAS, 256 rows) on Llama-3.1-8B shapes against gguf-py's
    weights times ``x`` in float64. Two shapes (K 4096 and 14336; the other two add no new K or
    specialization), and fp16 only 1 and 16 rows plus the large-batch path: each row count compiles
    its own kernel, and bf16 covers the others (the file ran past 150 s on an H100 with all of them)."""
    from runtime_quant.gguf_gpu import gguf_dequant_mm, gguf_gemm, gguf_gemv

    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    t = BY_NAME[name]
    gen = torch.Generator(device="cuda").manual_seed(5)
    cases = ((1, gguf_gemv), (4, gguf_gemv), (16, gguf_gemm), (256, gguf_gemm), (256, gguf_dequant_mm))
    if dtype == torch.float16:
        cases = ((1, gguf_gemv), (16, gguf_gemm), (256, gguf_dequant_mm))
    for in_features, out_features in GPU_SHAPES:
        raw = blocks(t, out_features, in_features, seed=in_features + out_features, device="cuda")
        w = dequantize(raw, t)  # float32 [out, in]
        head = raw[:64].cpu().numpy()  # gguf-py on a slice (the whole matrix would take seconds on the CPU)
        assert torch.equal(w[:64].cpu(), reference(head, t))
        for rows, kernel in cases:
            x = torch.randn(rows, in_features, device="cuda", generator=gen).to(dtype)
            out = kernel(raw, t, x, None)
            assert out.dtype == dtype
            _check(out, x, w, None, GPU_RTOL[dtype])
