"""runtime-plugin-rocm: AMD GPUs through a HIP build of torch.

Registers the ``rocm`` platform and, when the Triton attention backend of
runtime-plugin-cuda or runtime-kernels is installed, the shared ``triton`` backend.
"""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("runtime")


@hookimpl
def register_platforms(register):
    from runtime_rocm.platform import RocmPlatform

    register(RocmPlatform())


@hookimpl
def register_attention_backends(register):
    from runtime_rocm.triton_backend import register_shared_backend

    register_shared_backend(register)
