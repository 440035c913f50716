"""runtime-plugin-cuda: the CUDA platform.

* platform ``cuda`` (priority 10, above ``cpu``): NVIDIA GPUs through a CUDA build of
  torch; detection never initializes CUDA (see :mod:`runtime_cuda.platform`).

Its default attention backend, ``triton``, is registered by runtime-kernels (a
dependency) for every GPU platform; core's ``sdpa`` runs here too.
"""

from __future__ import annotations

from runtime import hookimpl


@hookimpl
def register_platforms(register):
    from runtime_cuda.platform import CudaPlatform

    register(CudaPlatform())
