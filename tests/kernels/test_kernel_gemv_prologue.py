"""silu_and_mul_gemv and rms_norm_gemv (Triton, also with ``gated``: the SiLU after a gate/up product)
against the unfused kernels and the references.

Each fused op must give what its two unfused ops give. Under the interpreter the launch shape
is fixed, so a prologue that rounds as the unfused kernel does feeds the same numbers to the same
loop and matches ``gemv(silu_and_mul(x))`` / ``gemv(rms_norm(x))`` bit for bit. The norm's mean
square is summed in another order than ``rms_norm``'s, so its inputs here are multiples of 1/4,
whose squares add up exactly in any order. The torch references sum the products in another order
and, in bfloat16, the interpreter rounds differently from torch (``support.kernel_testing``),
hence their tolerances; so do the compiled kernels, whose launch shapes the autotuner picks per
variant. The returned residual is always exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import runtime_kernels.gemv as gemv_module  # noqa: E402
from runtime_kernels.activation import silu_and_mul  # noqa: E402
from runtime_kernels.gemv import (  # noqa: E402
    gemv,
    rms_norm_gemv,
    rms_norm_gemv_ref,
    silu_and_mul_gemv,
    silu_and_mul_gemv_ref,
)
from runtime_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from runtime_kernels.utils import interpreting  # noqa: E402

from support.kernel_testing import tolerance

DTYPES = [torch.float16, torch.bfloat16]
# (N, K): neither a multiple of the interpreter's 4 x 64 tile; K=300 spans five slices.
SHAPES = [(37, 100), (5, 300)]
EPS = 1e-6


def make(n: int, k: int, dtype, device, *, in_features=None, bias=False, fp8=False, seed=0):
    """``(x, weight, bias, scale)``: ``x`` [1, in_features or k], weights of outputs about 1."""
    g = torch.Generator().manual_seed(seed * 1000 + n * k)
    x = torch.randn(1, in_features or k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    if not fp8:
        return x, w.to(device=device, dtype=dtype), b, None
    scale = torch.rand(n, generator=g) / 64 + 1 / 128
    codes = (w / scale[:, None]).to(torch.float8_e4m3fn)
    return x, codes.to(device), b, scale.to(device)


def quarters(k: int, dtype, device, seed: int) -> torch.Tensor:
    """[1, k] multiples of 1/4 in [-2, 2]: sums, squares and their sum are exact in any order."""
    return (torch.randint(-8, 9, (1, k), generator=torch.Generator().manual_seed(seed)) / 4).to(device=device, dtype=dtype)


def assert_same_as_unfused(out, unfused, dtype):
    if interpreting():
        assert torch.equal(out, unfused)  # the same products in the same order
    else:  # the autotuner may pick another launch shape for each
        torch.testing.assert_close(out, unfused, atol=tolerance(dtype), rtol=tolerance(dtype))


def norm_weight(k: int, gemma: bool, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    return (torch.randn(k, generator=g) * 0.2 + (0.0 if gemma else 1.0)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias,fp8", [(False, False), (True, False), (True, True)], ids=["plain", "bias", "fp8_bias"])
def test_silu_and_mul_gemv(device, dtype, n, k, bias, fp8):
    x, w, b, scale = make(n, k, dtype, device, in_features=2 * k, bias=bias, fp8=fp8)
    out = silu_and_mul_gemv(x, w, b, scale)
    assert out.shape == (1, n) and out.dtype == dtype
    assert_same_as_unfused(out, gemv(silu_and_mul(x), w, b, scale), dtype)
    tol = tolerance(dtype)
    torch.testing.assert_close(out, silu_and_mul_gemv_ref(x, w, b, scale), atol=tol, rtol=tol)
    torch.testing.assert_close(silu_and_mul_gemv(x[0], w, b, scale), out[0])  # a plain vector works too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
@pytest.mark.parametrize("n,k,bias,fp8", [(37, 100, False, False), (5, 300, True, False), (37, 100, True, True)],
                         ids=["plain", "bias", "fp8_bias"])
def test_rms_norm_gemv(device, dtype, gemma, with_residual, n, k, bias, fp8):
    _, w, b, scale = make(n, k, dtype, device, bias=bias, fp8=fp8)
    x = quarters(k, dtype, device, seed=n)
    residual = quarters(k, dtype, device, seed=n + 1) if with_residual else None
    nw = norm_weight(k, gemma, dtype, device)
    x_before, residual_before = x.clone(), None if residual is None else residual.clone()

    out, summed = rms_norm_gemv(x, residual, nw, EPS, gemma, w, b, scale)
    assert out.shape == (1, n) and out.dtype == dtype
    assert torch.equal(x, x_before) and (residual is None or torch.equal(residual, residual_before))  # untouched
    if residual is None:
        assert summed is x  # the embeddings are the residual stream, as in the unfused layer
        normed = rms_norm(x, nw, EPS, gemma)
    else:
        normed, kernel_sum = fused_add_rms_norm(x, residual, nw, EPS, gemma)
        assert summed.shape == x.shape and summed.dtype == dtype
        assert torch.equal(summed, kernel_sum) and torch.equal(summed, x + residual)
    assert_same_as_unfused(out, gemv(normed, w, b, scale), dtype)
    ref_out, ref_summed = rms_norm_gemv_ref(x, residual, nw, EPS, gemma, w, b, scale)
    torch.testing.assert_close(out, ref_out, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first_layer", "residual"])
@pytest.mark.parametrize("n,k,bias,fp8", [(74, 100, False, False), (10, 300, True, False), (74, 100, True, True)],
                         ids=["plain", "bias", "fp8_bias"])
def test_rms_norm_gemv_gated(device, dtype, with_residual, n, k, bias, fp8):
    """The norm, a [gate | up] product and ``silu(gate) * up`` in one launch: what the norm, the gemv and
    ``silu_and_mul`` give one after another (each of gate and up rounded before the activation)."""
    from runtime_kernels.activation import silu_and_mul_ref

    _, w, b, scale = make(n, k, dtype, device, bias=bias, fp8=fp8)
    x = quarters(k, dtype, device, seed=n)
    residual = quarters(k, dtype, device, seed=n + 1) if with_residual else None
    nw = norm_weight(k, False, dtype, device)
    out, summed = rms_norm_gemv(x, residual, nw, EPS, False, w, b, scale, gated=True)
    assert out.shape == (1, n // 2) and out.dtype == dtype
    plain, plain_summed = rms_norm_gemv(x, residual, nw, EPS, False, w, b, scale)
    assert torch.equal(summed, plain_summed)
    assert_same_as_unfused(out, silu_and_mul(plain), dtype)
    ref_out, _ = rms_norm_gemv_ref(x, residual, nw, EPS, False, w, b, scale)
    torch.testing.assert_close(out, silu_and_mul_ref(ref_out), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_is_rounded_once_and_whole(device, dtype):
    """N=64 over 16 programs (the interpreter's 4 rows each), K=260: one program writes all of
    ``x + residual``, every slice of it, the ragged last one too, rounded once as the norm kernel
    rounds it (torch's rounding, but in the interpreter's bfloat16)."""
    x, w, _, _ = make(64, 260, dtype, device)
    residual = torch.randn(1, 260, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    nw = norm_weight(260, False, dtype, device)
    out, summed = rms_norm_gemv(x, residual, nw, EPS, False, w)
    assert torch.equal(summed, fused_add_rms_norm(x, residual, nw, EPS)[1])
    if not (dtype == torch.bfloat16 and interpreting()):
        assert torch.equal(summed, x + residual)


def test_every_tuned_launch_shape_with_a_prologue(device):
    """Each launch shape the autotuner may pick, with each prologue, on 16- and 8-bit weights."""
    from runtime_kernels.jit.gemv import GEMV_8BIT_CONFIGS, GEMV_CONFIGS, gemv_kernel

    n, k, dtype = 7, 300, torch.bfloat16
    x16, w16, _, _ = make(n, k, dtype, device, in_features=2 * k)
    _, w8, _, scale = make(n, k, dtype, device, fp8=True)
    residual = torch.randn(k, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    nw = norm_weight(k, False, dtype, device)
    act = silu_and_mul(x16)[0]
    normed, summed = fused_add_rms_norm(x16[0, :k], residual, nw, EPS)
    for weight, configs, row_scale in ((w16, GEMV_CONFIGS, None), (w8, GEMV_8BIT_CONFIGS, scale)):
        dequantized = weight.float() * (1 if row_scale is None else row_scale[:, None])
        gated = torch.nn.functional.silu((normed.float() @ dequantized.t())[:3]) * (normed.float() @ dequantized.t())[3:6]
        norm = dict(PROLOGUE=2, residual_ptr=residual, norm_w_ptr=nw, eps=EPS, HAS_RESIDUAL=True)
        cases = (  # (prologue arguments, the product expected)
            (dict(PROLOGUE=1), act.float() @ dequantized.t()),
            (norm, normed.float() @ dequantized.t()),
            ({**norm, "GATED": True}, gated),  # rows 0-2 gate, 3-5 up (row 6 unused)
            (dict(PROLOGUE=0, GATED=True), torch.nn.functional.silu((x16[0, :k].float() @ dequantized.t())[:3])
             * (x16[0, :k].float() @ dequantized.t())[3:6]),
        )
        for prologue, expected in cases:
            rows = 3 if prologue.get("GATED") else n
            for config in configs:
                out = torch.empty(rows, dtype=dtype, device=device)
                res_out = torch.zeros(k, dtype=dtype, device=device)
                if prologue["PROLOGUE"] == 2:
                    prologue["residual_out_ptr"] = res_out
                gemv_kernel[(-(-rows // config.kwargs["BLOCK_N"]),)](
                    x16[0], weight, out if row_scale is None else row_scale, out, out, rows, k, weight.stride(0),
                    HAS_SCALE=row_scale is not None, HAS_BIAS=False, **config.kwargs, **prologue,
                    num_warps=config.num_warps, num_stages=config.num_stages)
                label = f"{config} PROLOGUE={prologue['PROLOGUE']} GATED={prologue.get('GATED', False)}"
                torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2, msg=lambda m: f"{label}: {m}")
                if prologue["PROLOGUE"] == 2:
                    assert torch.equal(res_out, summed), label


def test_shapes_are_checked(device):
    w = torch.zeros(4, 8, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="one row"):
        silu_and_mul_gemv(torch.zeros(2, 16, device=device, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="expects 16"):
        silu_and_mul_gemv(torch.zeros(1, 8, device=device, dtype=torch.float16), w)
    x = torch.zeros(1, 8, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="norm_weight shape"):
        rms_norm_gemv(x, None, torch.ones(4, device=device, dtype=torch.float16), EPS, False, w)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm_gemv(x, torch.zeros(8, device=device, dtype=torch.float16), w[0], EPS, False, w)
    with pytest.raises(ValueError, match="an even number; got 3"):
        rms_norm_gemv(x, None, w[0], EPS, False, w[:3], gated=True)


# Llama-3.1-8B's layers on the GPU (compiled, autotuned): q/k/v after the input norm
# (K=4096 -> N=6144) and down after gate/up (2 x 14336 -> 4096), bfloat16 and FP8 weights.
# ``fused``: 16-bit weights' norm / SiLU inside the Triton gemv (RUNTIME_GEMV_FUSED_PROLOGUES=1) rather than apart.
@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_llama_8b_shapes_on_the_gpu(fp8, fused, monkeypatch):
    monkeypatch.setattr(gemv_module, "FUSED_PROLOGUES", fused)
    dtype = torch.bfloat16
    x, w, b, scale = make(4096, 14336, dtype, "cuda", in_features=2 * 14336, bias=True, fp8=fp8, seed=1)
    out = silu_and_mul_gemv(x, w, b, scale)
    torch.testing.assert_close(out, gemv(silu_and_mul(x), w, b, scale), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, silu_and_mul_gemv_ref(x, w, b, scale), atol=1e-2, rtol=1e-2)

    x, w, _, scale = make(6144, 4096, dtype, "cuda", fp8=fp8, seed=2)
    residual = torch.randn_like(x)
    for gemma in (False, True):
        nw = norm_weight(4096, gemma, dtype, "cuda")
        out, summed = rms_norm_gemv(x, residual, nw, EPS, gemma, w, None, scale)
        assert torch.equal(summed, x + residual)
        normed, _ = fused_add_rms_norm(x, residual, nw, EPS, gemma)
        torch.testing.assert_close(out, gemv(normed, w, None, scale), atol=1.6e-2, rtol=1.6e-2)
        ref_out = rms_norm_gemv_ref(x, residual, nw, EPS, gemma, w, None, scale)[0]
        torch.testing.assert_close(out, ref_out, atol=1.6e-2, rtol=1.6e-2)
        first, same = rms_norm_gemv(x, None, nw, EPS, gemma, w, None, scale)
        assert same is x
        torch.testing.assert_close(first, gemv(rms_norm(x, nw, EPS, gemma), w, None, scale), atol=1.6e-2, rtol=1.6e-2)

    # gate/up (K=4096 -> 2 x 14336) after the post-attention norm, with the SiLU as it stores
    x, w, b, scale = make(2 * 14336, 4096, dtype, "cuda", bias=True, fp8=fp8, seed=3)
    residual = torch.randn_like(x)
    nw = norm_weight(4096, False, dtype, "cuda")
    out, summed = rms_norm_gemv(x, residual, nw, EPS, False, w, b, scale, gated=True)
    assert out.shape == (1, 14336) and torch.equal(summed, x + residual)
    unfused = silu_and_mul(gemv(fused_add_rms_norm(x, residual, nw, EPS)[0], w, b, scale))
    torch.testing.assert_close(out, unfused, atol=1.6e-2, rtol=1.6e-2)
