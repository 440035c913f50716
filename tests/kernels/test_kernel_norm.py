"""rms_norm / fused_add_rms_norm (Triton) against the references and the model's RMSNorm."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime.models.layers import GemmaRMSNorm, RMSNorm  # noqa: E402
from runtime_kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from runtime_kernels.utils import interpreting  # noqa: E402

from support.kernel_testing import tolerance



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_reference(device, dtype, hidden, gemma):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(3, 5, hidden, generator=gen).to(device=device, dtype=dtype)
    residual = torch.randn(3, 5, hidden, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.2 + (0.0 if gemma else 1.0)).to(device=device, dtype=dtype)
    tol = tolerance(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, gemma), rms_norm_ref(x, weight, 1e-6, gemma), atol=tol, rtol=tol)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6, gemma)
    ref_out, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6, gemma)
    if dtype == torch.bfloat16 and interpreting():
        torch.testing.assert_close(summed, ref_summed, atol=tol, rtol=tol)
    else:
        assert torch.equal(summed, ref_summed)  # the residual stream is bit-exact
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("cls, gemma", [(RMSNorm, False), (GemmaRMSNorm, True)])
def test_reference_is_the_model_layer(cls, gemma):
    layer = cls(32, eps=1e-5)
    with torch.no_grad():
        layer.weight.add_(torch.randn(32) * 0.3)
    x = torch.randn(7, 32)
    torch.testing.assert_close(rms_norm_ref(x, layer.weight.detach(), 1e-5, gemma), layer(x).detach())
