"""Fused-op model tests launch Triton kernels: in its CPU interpreter unless a GPU compiles them.

``TRITON_INTERPRET`` must be set before Triton is imported, so it is set here at
collection time, as in tests/kernels (an explicit value in the environment wins).
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where models that use Triton kernels run: ``cpu`` under the interpreter, else ``cuda``."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=0 needs a CUDA GPU")
    return "cuda"
