"""runtime-kernels: Triton kernels shared by the GPU plugins, each next to a plain-torch reference.

Every public module holds one idea: a launcher that runs the Triton kernel and a
``*_ref`` function that computes the same thing in plain PyTorch (the tests compare
them). Triton is imported only when a kernel is launched, from the ``jit`` subpackage,
so this package imports on machines without Triton.

Modules:

* :mod:`runtime_kernels.attention` -- paged attention over mixed prefill + decode batches
* :mod:`runtime_kernels.kv_cache` -- writing new keys/values into the paged cache
* :mod:`runtime_kernels.norm` -- RMSNorm, optionally fused with the residual add
* :mod:`runtime_kernels.rotary` -- rotary embedding (NeoX layout) from a cos/sin cache
* :mod:`runtime_kernels.activation` -- SiLU-and-mul
* :mod:`runtime_kernels.sampling` -- top-k / top-p filtering without a full sort (torch only)
"""

from runtime_kernels.utils import has_triton

__all__ = ["has_triton"]
