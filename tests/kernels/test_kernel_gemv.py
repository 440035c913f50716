"""gemv (Triton) against F.linear in float32, for one row."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime_kernels.gemv import gemv, gemv_ref  # noqa: E402

from support.kernel_testing import tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(37, 100, False), (64, 256, True), (5, 33, True)])
def test_matches_reference(device, dtype, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
    out = gemv(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    tol = tolerance(dtype)
    torch.testing.assert_close(out, gemv_ref(x, w, b), atol=tol, rtol=tol)
    torch.testing.assert_close(gemv(x[0], w, b), out[0])  # a plain vector works too


def test_strided_weight_rows(device):
    """A slice of a wider matrix (rows at a larger stride), as a tied or merged weight may be."""
    big = torch.randn(20, 96, device=device)
    w = big[:, 16:80]
    x = torch.randn(1, 64, device=device)
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), atol=1e-5, rtol=1e-5)


def test_more_than_one_row_is_an_error(device):
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device))


def test_every_tuned_launch_shape(device):
    """Each launch shape the autotuner may pick (the GPU runs one of them per layer shape; the
    interpreter otherwise runs a fixed one): 16- and 8-bit weights, with row scales, ragged K."""
    from runtime_kernels.jit.gemv import GEMV_8BIT_CONFIGS, GEMV_CONFIGS, gemv_kernel

    g = torch.Generator().manual_seed(0)
    n, k = 7, 300
    x = torch.randn(k, generator=g).to(device=device, dtype=torch.bfloat16)
    w16 = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=torch.bfloat16)
    scale = torch.rand(n, generator=g).to(device) + 0.5
    w8 = w16.float().mul(64).to(torch.float8_e4m3fn)
    for weight, configs, row_scale in ((w16, GEMV_CONFIGS, None), (w8, GEMV_8BIT_CONFIGS, scale)):
        expected = torch.nn.functional.linear(x.float(), weight.float() * (1 if row_scale is None else row_scale[:, None]))
        for config in configs:
            out = torch.empty(n, dtype=torch.bfloat16, device=device)
            grid = (-(-n // config.kwargs["BLOCK_N"]),)
            gemv_kernel[grid](x, weight, out if row_scale is None else row_scale, out, out, n, k, weight.stride(0),
                              HAS_SCALE=row_scale is not None, HAS_BIAS=False, **config.kwargs,
                              num_warps=config.num_warps, num_stages=config.num_stages)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2, msg=lambda m: f"{config}: {m}")
