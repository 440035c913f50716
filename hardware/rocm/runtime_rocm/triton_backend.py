"""The ``triton`` attention backend, shared with runtime-plugin-cuda.

The backend (``runtime_cuda.triton_attention``) only launches runtime-kernels' Triton
kernels, which compile for NVIDIA, AMD (HIP) and Intel (XPU) GPUs alike, so the GPU
plugins share it instead of each shipping a copy. The name is registered only when
the backend's module can be found (it is imported when the backend is chosen).
Whichever GPU plugin loads first registers it for every GPU platform; a later one
finds the name taken and reuses that registration, which therefore has to list this
platform too.
"""

from __future__ import annotations

from runtime.plugins import find_installed, register_shared

BACKEND_NAME = "triton"
GPU_PLATFORMS = ("cuda", "rocm", "xpu")
# "module:Class" of the backend; the first one installed is used.
BACKEND_TARGETS = ("runtime_cuda.triton_attention:TritonAttentionBackend",)


def find_backend_target() -> str | None:
    return find_installed(BACKEND_TARGETS)


def register_shared_backend(register) -> str | None:
    """Register ``triton`` if its code is installed and no earlier plugin did; return the target."""
    return register_shared(register, BACKEND_NAME, BACKEND_TARGETS, GPU_PLATFORMS)
