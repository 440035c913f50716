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
