"""Kernel tests compile for the GPU when one is visible, else run Triton's interpreter on the CPU.

``TRITON_INTERPRET`` must be set before Triton is imported, so it is set here at
collection time (an explicit value in the environment wins). The device count comes
from NVML and does not initialize CUDA.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")


@pytest.fixture(scope="session")
def device() -> str:
    """``cpu`` under the interpreter, ``cuda`` when compiling for a GPU."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=0 needs a CUDA GPU")
    return "cuda"

