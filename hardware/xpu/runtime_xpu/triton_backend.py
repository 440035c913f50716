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

import importlib
import importlib.util

from runtime.plugins import PluginError

BACKEND_NAME = "triton"
GPU_PLATFORMS = ("cuda", "rocm", "xpu")
# "module:Class" of the backend; the first one installed is used.
BACKEND_TARGETS = ("runtime_cuda.triton_attention:TritonAttentionBackend",)


def find_backend_target() -> str | None:
    """The first target whose module is importable, found without importing it."""
    for target in BACKEND_TARGETS:
        module = target.partition(":")[0]
        try:
            if importlib.util.find_spec(module) is not None:
                return target
        except ModuleNotFoundError:  # the parent package is not installed
            continue
    return None


def lazy_backend(target: str):
    """A factory that imports ``module:Class`` and instantiates it when called."""

    def factory():
        module, _, cls = target.partition(":")
        return getattr(importlib.import_module(module), cls)()

    factory.target = target
    return factory


def register_shared_backend(register) -> str | None:
    """Register ``triton`` if its code is installed and no earlier plugin did; return the target."""
    target = find_backend_target()
    if target is None:
        return None
    try:
        register(BACKEND_NAME, lazy_backend(target), platforms=list(GPU_PLATFORMS))
    except PluginError:
        # The only way this fixed, valid name fails is a registration by an earlier GPU
        # plugin (cuda, rocm and xpu load in that order): that one serves us too.
        return None
    return target
