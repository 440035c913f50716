"""The dense one-row CUDA GEMV (runtime_kernels.gemv_cuda) behind runtime_kernels.gemv on a GPU (opted in here).

GPU only (CUDA C compiled by NVRTC). Against the float32 references of runtime_kernels.gemv and the
Triton gemv (``gemv_cuda.ENABLED`` off) for FP8 (row scales) and 16-bit weights, both activation
dtypes: the Llama-3-8B shapes, N not a multiple of a warp's rows, K not a multiple of a warp's
512-byte stretch, every row shape; bias; the prologues (SiLU-and-mul, RMSNorm with and without a
residual, Gemma's) against the separate kernels, with the residual sum exact; a grid smaller than
the rows (blocks taking several rounds); rows strided in a larger tensor; and a chain of GEMVs with
prologues captured in a CUDA graph (programmatic dependent launch on sm_90+) replayed on new inputs.
"""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import gemv_cuda
from runtime_kernels.activation import silu_and_mul
from runtime_kernels.gemv import gemv, gemv_ref, rms_norm_gemv, rms_norm_gemv_ref, silu_and_mul_gemv, silu_and_mul_gemv_ref
from runtime_kernels.norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
SHAPES = [(6144, 4096), (4096, 14336), (1000, 896), (37, 528), (5, 16)]


@pytest.fixture(autouse=True)
def _on_a_gpu(monkeypatch):
    if not torch.cuda.is_available():
        pytest.fail("a gpu test ran without a GPU")
    monkeypatch.setattr(gemv_cuda, "ENABLED", True)  # RUNTIME_GEMV_CUDA=1


def make(n, k, dtype, *, fp8=False, bias=False, in_features=None, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + n + k)
    x = torch.randn(1, in_features or k, generator=g).to(dtype).cuda()
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g).to(dtype).cuda() if bias else None
    if not fp8:
        return x, w.to(dtype).cuda(), b, None
    scale = torch.rand(n, generator=g) / 64 + 1 / 128
    return x, (w / scale[:, None]).to(torch.float8_e4m3fn).cuda(), b, scale.cuda()


def tol(out: torch.Tensor, k: int) -> dict:
    # float32 sums in another order than the references', rounded once to 16 bits
    return dict(atol=2e-3 * max(1.0, out.float().abs().max().item()), rtol=1e-2 if out.dtype == torch.bfloat16 else 2e-3)


def triton(fn, *args, **kwargs):
    saved, gemv_cuda.ENABLED = gemv_cuda.ENABLED, False
    try:
        return fn(*args, **kwargs)
    finally:
        gemv_cuda.ENABLED = saved


def test_calls_take_the_cuda_kernel(monkeypatch):
    calls = []
    original = gemv_cuda.gemv
    monkeypatch.setattr(gemv_cuda, "gemv", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    for fp8 in (False, True):
        x, w, b, scale = make(256, 4096, torch.bfloat16, fp8=fp8)
        gemv(x, w, b, scale)
    assert len(calls) == 2
    x, w, _, _ = make(64, 100, torch.bfloat16)  # K not a multiple of 16: the Triton kernel
    gemv(x, w)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fp8,bias", [(False, False), (True, False), (True, True), (False, True)])
def test_gemv(dtype, n, k, fp8, bias):
    x, w, b, scale = make(n, k, dtype, fp8=fp8, bias=bias)
    assert gemv_cuda.supports(x[0], w)
    out = gemv(x, w, b, scale)
    assert out.shape == (1, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), gemv_ref(x, w, b, scale).float(), **tol(out, k))
    torch.testing.assert_close(out.float(), triton(gemv, x, w, b, scale).float(), **tol(out, k))


@pytest.mark.parametrize("shape", gemv_cuda.SHAPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_every_row_shape(shape, fp8):
    n, k = 1003, 1552  # 1003 rows: no row shape divides it; 1552: three stretches and a part
    x, w, b, scale = make(n, k, torch.bfloat16, fp8=fp8, bias=True)
    out = torch.empty(n, dtype=x.dtype, device="cuda")
    gemv_cuda.gemv(x[0], w, b, scale, out, shape=shape)
    torch.testing.assert_close(out.float(), gemv_ref(x, w, b, scale)[0].float(), **tol(out, k))


@pytest.mark.parametrize("fp8", [False, True])
def test_blocks_of_several_rounds(fp8, monkeypatch):
    """A GPU made to look like one multiprocessor: each block's warps take many rounds of rows."""
    monkeypatch.setattr(gemv_cuda, "_resident_blocks", lambda kern, index, shared: 1)
    for prologue in ("plain", "norm"):
        x, w, b, scale = make(4096, 1024, torch.bfloat16, fp8=fp8, bias=True, seed=3)
        if prologue == "plain":
            out, want = gemv(x, w, b, scale), gemv_ref(x, w, b, scale)
        else:
            weight = torch.rand(1024, device="cuda").to(torch.bfloat16) + 0.5
            out, _ = rms_norm_gemv(x, x.clone(), weight, 1e-6, False, w, b, scale)
            want, _ = rms_norm_gemv_ref(x, x.clone(), weight, 1e-6, False, w, b, scale)
        torch.testing.assert_close(out.float(), want.float(), **tol(out, 1024))


def test_strided_weight_rows():
    x, w, _, _ = make(512, 2048, torch.bfloat16)
    wide = torch.zeros(512, 2048 + 64, dtype=w.dtype, device="cuda")
    wide[:, :2048] = w
    view = wide[:, :2048]
    assert gemv_cuda.supports(x[0], view)
    torch.testing.assert_close(gemv(x, view).float(), gemv_ref(x, w).float(), **tol(x, 2048))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k", [(28672, 4096), (1000, 896)])
def test_silu_and_mul_prologue(dtype, fp8, n, k):
    x, w, b, scale = make(n, k, dtype, fp8=fp8, bias=True, in_features=2 * k)
    out = silu_and_mul_gemv(x, w, b, scale)
    # the activation rounds as the separate kernel rounds it (its exp may differ in the last bit)
    torch.testing.assert_close(out.float(), gemv(silu_and_mul(x), w, b, scale).float(), **tol(out, k))
    torch.testing.assert_close(out.float(), silu_and_mul_gemv_ref(x, w, b, scale).float(), **tol(out, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_prologue(dtype, fp8, gemma, with_residual):
    n, k = 6144, 4096
    x, w, b, scale = make(n, k, dtype, fp8=fp8)
    residual = torch.randn_like(x) if with_residual else None
    weight = (torch.randn(k, device="cuda") * 0.2 + (0.0 if gemma else 1.0)).to(dtype)
    out, summed = rms_norm_gemv(x, residual, weight, 1e-6, gemma, w, b, scale)
    if with_residual:
        normed, want_sum = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6, gemma=gemma)
        assert torch.equal(summed, want_sum)
    else:
        normed = rms_norm(x, weight, 1e-6, gemma=gemma)
        assert summed is x
    # the block's mean square is summed in another order than rms_norm's: close, not always equal
    torch.testing.assert_close(out.float(), gemv(normed, w, b, scale).float(), **tol(out, k))
    want, _ = rms_norm_gemv_ref(x, residual, weight, 1e-6, gemma, w, b, scale)
    torch.testing.assert_close(out.float(), want.float(), **tol(out, k))


@pytest.mark.parametrize("fp8", [False, True])
def test_a_layer_of_gemvs_in_a_cuda_graph(fp8):
    """norm -> qkv, o, norm -> gate_up, SiLU -> down, chained as a decode step chains them, captured in a graph
    (launched with programmatic dependent launch on sm_90+) and replayed on new inputs: each replay as eager."""
    torch.manual_seed(0)
    dtype, hidden, inter = torch.bfloat16, 1024, 2816
    layers = {name: make(n, k, dtype, fp8=fp8, seed=i)[1:4:2] for i, (name, n, k) in enumerate(
        [("qkv", 1536, hidden), ("o", hidden, 1024), ("gate_up", 2 * inter, hidden), ("down", hidden, inter)])}
    norm1, norm2 = (torch.rand(hidden, device="cuda").to(dtype) + 0.5 for _ in range(2))
    x = torch.randn(1, hidden, device="cuda").to(dtype)
    residual = torch.randn(1, hidden, device="cuda").to(dtype)

    def step():
        qkv, s = rms_norm_gemv(x, residual, norm1, 1e-5, False, layers["qkv"][0], None, layers["qkv"][1])
        o = gemv(qkv[:, :1024], layers["o"][0], None, layers["o"][1])
        gate_up, s2 = rms_norm_gemv(o, s, norm2, 1e-5, False, layers["gate_up"][0], None, layers["gate_up"][1])
        return silu_and_mul_gemv(gate_up, layers["down"][0], None, layers["down"][1]), s2

    step()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, s2 = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(1, hidden, generator=g).to(dtype))
        residual.copy_(torch.randn(1, hidden, generator=g).to(dtype))
        graph.replay()
        want, want_s2 = step()
        assert torch.equal(out, want) and torch.equal(s2, want_s2)
