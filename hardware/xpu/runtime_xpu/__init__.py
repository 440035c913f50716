"""runtime-plugin-xpu: Intel GPUs through torch.xpu.

Registers the ``xpu`` platform and, when the Triton attention backend of
runtime-plugin-cuda or runtime-kernels is installed (and no GPU plugin loaded before
this one registered it), the shared ``triton`` backend.
"""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("runtime")


@hookimpl
def register_platforms(register):
    from runtime_xpu.platform import XpuPlatform

    register(XpuPlatform())


@hookimpl
def register_attention_backends(register):
    from runtime_xpu.triton_backend import register_shared_backend

    register_shared_backend(register)
