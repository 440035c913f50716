"""The CUDA plugin's tests: the Triton backend runs in Triton's interpreter when no GPU is visible.

``TRITON_INTERPRET`` must be set before Triton is imported (an explicit value in the
environment wins). ``torch.cuda.device_count()`` asks NVML and does not start CUDA.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")


@pytest.fixture(scope="session")
def device() -> str:
    """``cpu`` under the interpreter, ``cuda`` when Triton compiles for a GPU."""
    return "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
