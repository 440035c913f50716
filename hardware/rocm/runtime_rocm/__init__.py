"""runtime-plugin-rocm: AMD GPUs through a HIP build of torch.

Registers the ``rocm`` platform. Its default attention backend, ``triton``, is
registered by runtime-kernels (a dependency) for every GPU platform.
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_platforms(register):
    from runtime_rocm.platform import RocmPlatform

    register(RocmPlatform())
