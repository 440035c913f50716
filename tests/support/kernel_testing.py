"""Tolerances shared by the kernel tests."""

import torch


# The interpreter rounds float -> bfloat16 toward zero-ish (not to nearest even as GPUs
# do), so bfloat16 results may differ from torch by a couple of units in the last place.
BF16_TOL = 3e-2


def tolerance(dtype: torch.dtype) -> float:
    """Absolute and relative tolerance for comparing a kernel's output in ``dtype``."""
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: BF16_TOL}[dtype]
