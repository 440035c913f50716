"""runtime-kernels as a plugin: it registers the ``triton`` attention backend, once.

The backend only launches this package's Triton kernels, which compile for NVIDIA,
AMD (HIP) and Intel (XPU) GPUs alike, so it is registered here for every GPU platform
rather than by each platform plugin (runtime-plugin-cuda, -rocm and -xpu depend on this
package). The backend's module is imported only when the backend is chosen.
"""

from __future__ import annotations

import torch

from runtime import hookimpl

GPU_PLATFORMS = ["cuda", "rocm", "xpu"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def triton_backend():
    from runtime_kernels.attention_backend import TritonAttentionBackend

    return TritonAttentionBackend()


@hookimpl
def register_attention_backends(register):
    register("triton", triton_backend, platforms=GPU_PLATFORMS, dtypes=DTYPES)
