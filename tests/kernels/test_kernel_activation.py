"""silu_and_mul (Triton) against the model's SiluAndMul."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime.models.layers import SiluAndMul  # noqa: E402
from runtime_kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402

from support.kernel_testing import tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 96), (2, 3, 2 * 1100)])
def test_matches_reference(device, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(device=device, dtype=dtype)
    ref = silu_and_mul_ref(x)
    torch.testing.assert_close(ref, SiluAndMul()(x))
    tol = tolerance(dtype)
    torch.testing.assert_close(silu_and_mul(x), ref, atol=tol, rtol=tol)


def test_odd_width_is_an_error():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(2, 7))
