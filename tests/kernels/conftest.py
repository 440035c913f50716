"""Kernel tests compile for the GPU when one is visible, else run Triton's interpreter on the CPU
(the root conftest chooses ``TRITON_INTERPRET``)."""

import pytest


@pytest.fixture(scope="session")
def device(kernel_device) -> str:
    return kernel_device
