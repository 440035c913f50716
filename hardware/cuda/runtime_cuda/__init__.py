"""runtime-plugin-cuda: the CUDA platform and its attention backends.

* platform ``cuda`` (priority 10, above ``cpu``): NVIDIA GPUs through a CUDA build of
  torch; detection never initializes CUDA (see :mod:`runtime_cuda.platform`);
* attention backend ``triton`` (the platform's default): the unified paged-attention
  kernel of ``runtime-kernels``;
* attention backend ``sdpa``: gathers the paged keys and calls torch's
  ``scaled_dot_product_attention``; a slower, simple fallback that also runs on ``cpu``.

Both backends use the KV layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import pluggy
import torch

hookimpl = pluggy.HookimplMarker("runtime")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@hookimpl
def register_platforms(register):
    from runtime_cuda.platform import CudaPlatform

    register(CudaPlatform())


@hookimpl
def register_attention_backends(register):
    def triton_factory():
        from runtime_cuda.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()

    def sdpa_factory():
        from runtime_cuda.sdpa_attention import SdpaAttentionBackend

        return SdpaAttentionBackend()

    # Triton kernels compile for AMD and Intel GPUs too: the rocm and xpu plugins reuse
    # this registration rather than registering the name again (only run on CUDA so far).
    register("triton", triton_factory, platforms=["cuda", "rocm", "xpu"], dtypes=DTYPES)
    register("sdpa", sdpa_factory, platforms=["cuda", "cpu"], dtypes=DTYPES)
