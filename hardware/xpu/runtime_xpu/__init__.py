"""runtime-plugin-xpu: Intel GPUs through torch.xpu.

Registers the ``xpu`` platform. Its default attention backend, ``triton``, is
registered by runtime-kernels (a dependency) for every GPU platform.
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_platforms(register):
    from runtime_xpu.platform import XpuPlatform

    register(XpuPlatform())
