"""A one-row GEMV in CUDA (``cuda/dense_gemv.cu``) for FP8 (e4m3, row scales) and 16-bit weights, which
:mod:`runtime_kernels.gemv` runs in place of its Triton kernel with ``RUNTIME_GEMV_CUDA=1`` (off by default:
measured slower, see below).

Its grid is one wave (as many blocks as the GPU holds at once), so a prologue (the RMSNorm or SiLU-and-mul
before the layer) is computed once a block rather than once a program, and in CUDA graphs it is launched
with programmatic dependent launch on sm_90+: each GEMV requests its first weights before it waits for the
kernel before it. On an H100 its plain calls read the Llama-3-8B layers at the Triton kernel's rate
(2.6-3.1 TB/s), but each block prepares the whole row of x, a serial stretch before its weights stream:
W3 went 3.61 -> 3.76 ms with FP8 weights and 5.71 -> 5.76 ms in bf16 (benchmarks/RESULTS.md, session 18).
``RUNTIME_GEMV_CUDA_PDL=0``: plain launches; ``RUNTIME_GEMV_CUDA_PROLOGUES=0``: FP8 layers keep their norm and SiLU apart; ``RUNTIME_GEMV_CUDA_SHAPE="rows,stretches"``: the rows a warp
takes at a time and the 512-byte stretches of each it has in flight (default ``2,8``).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from runtime.envs import env_flag

from runtime_kernels import cuda_launch

PLAIN, SILU_AND_MUL, RMS_NORM, GEMMA_RMS_NORM = 0, 1, 2, 3  # the kernel's prologues (template P)
THREADS = 256
SHAPES = ((2, 8), (1, 8), (4, 4), (2, 4))  # (rows a warp, stretches in flight) compiled on request
MAX_SHARED = 48 * 1024  # x after the prologue, 2 K bytes: K up to 24,576 without an opt-in
ACTIVATION_TYPES = {torch.bfloat16: "gemv_common::bf16", torch.float16: "gemv_common::f16"}
FP8 = getattr(torch, "float8_e4m3fn", None)


def _shape_setting(text: str) -> tuple[int, int]:
    fields = text.split(",")
    shape = tuple(int(f) for f in fields) if len(fields) == 2 and all(f.strip().isdigit() for f in fields) else None
    if shape not in SHAPES:
        raise ValueError(f"RUNTIME_GEMV_CUDA_SHAPE={text!r}: it takes rows,stretches, one of "
                         f"{', '.join(f'{r},{u}' for r, u in SHAPES)}")
    return shape


ENABLED = env_flag("RUNTIME_GEMV_CUDA", False)
PDL = env_flag("RUNTIME_GEMV_CUDA_PDL")
# Whether layers with their own scales (FP8) fuse the norm / SiLU before them into this kernel (see
# runtime_quant.gpu.fp8_gemv_weights); RUNTIME_GEMV_CUDA_PROLOGUES=0: plain calls, the ops apart.
PROLOGUES = env_flag("RUNTIME_GEMV_CUDA_PROLOGUES")
SHAPE = _shape_setting(os.environ.get("RUNTIME_GEMV_CUDA_SHAPE", "2,8"))


def _weight_type(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> str | None:
    if weight_dtype == x_dtype:
        return ACTIVATION_TYPES[x_dtype]
    return "dense_gemv::e4m3" if FP8 is not None and weight_dtype == FP8 else None


@functools.cache
def kernel(device_index: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, prologue: int = PLAIN,
           shape: tuple[int, int] = SHAPE):
    """The compiled kernel for these types, prologue and shape, or None where it does not compile."""
    name = f"dense_gemv::gemv<{ACTIVATION_TYPES[x_dtype]}, {_weight_type(weight_dtype, x_dtype)}, {shape[0]}, {shape[1]}, {prologue}>"
    compiled = cuda_launch.compile_kernels(cuda_launch.source("dense_gemv.cu"), [name], device_index)
    return None if compiled is None else compiled[name]


def takes(weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """Whether the kernel takes rows of ``x_dtype`` through ``weight`` [N, K] on its GPU: a 16-bit ``x_dtype``,
    weights of that dtype or FP8 (sm_89+), 16-byte aligned rows, K a multiple of 16 up to 24,576."""
    if not (ENABLED and weight.device.type == "cuda" and x_dtype in ACTIVATION_TYPES and weight.dim() == 2):
        return False
    k = weight.shape[1]
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return (
        _weight_type(weight.dtype, x_dtype) is not None
        and (weight.dtype != FP8 or cuda_launch.fp8_conversions(index))
        and k % 16 == 0 and 2 * k <= MAX_SHARED
        and weight.stride(1) == 1 and weight.data_ptr() % 16 == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0
        and kernel(index, x_dtype, weight.dtype) is not None
    )


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` (one contiguous row, on ``weight``'s GPU) through ``weight``: see :func:`takes`."""
    return x.device == weight.device and x.data_ptr() % 16 == 0 and takes(weight, x.dtype)


def operands_fit(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether the prologue's other inputs (residual, norm weight) are like ``x``: its dtype, contiguous, aligned."""
    return all(t is None or (t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors)


@functools.cache
def _resident_blocks(kern, device_index: int, shared_mem: int) -> int:
    """Blocks of ``kern`` the whole GPU holds at once."""
    return cuda_launch.num_sms(device_index) * cuda_launch.max_blocks_per_sm(kern, THREADS, shared_mem, fallback=2)


def _blocks(kern, device: torch.device, tasks: int, shared_mem: int) -> int:
    """One wave: a block per 8 tasks (a warp's rows each), at most as many as the GPU holds at once."""
    return max(1, min(-(-tasks // (THREADS // 32)), _resident_blocks(kern, device.index, shared_mem)))


def gemv(vec: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
         out: torch.Tensor, prologue: int = PLAIN, residual: torch.Tensor | None = None,
         norm_w: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, eps: float = 0.0,
         gemma: bool = False, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """``out`` [N] = ``prologue(vec) @ weight.T * scale + bias``: ``vec`` [K] ([2 K] with SILU_AND_MUL), the
    norm prologue's ``residual`` / ``norm_w`` / ``residual_out`` / ``eps`` as in :func:`runtime_kernels.gemv.rms_norm_gemv`."""
    if prologue == RMS_NORM and gemma:
        prologue = GEMMA_RMS_NORM
    shape = shape or SHAPE
    n, k = weight.shape
    kern = kernel(vec.device.index, vec.dtype, weight.dtype, prologue, shape)
    shared_mem = 2 * k
    args = (
        vec.data_ptr(), weight.data_ptr(), scale.data_ptr() if scale is not None else 0,
        bias.data_ptr() if bias is not None else 0, out.data_ptr(), np.int32(n), np.int32(k), np.int64(weight.stride(0)),
        np.int32(scale is not None), np.int32(bias is not None),
        residual.data_ptr() if residual is not None else 0, norm_w.data_ptr() if norm_w is not None else 0,
        residual_out.data_ptr() if residual_out is not None else 0, np.float32(eps),
    )
    grid = (_blocks(kern, vec.device, -(-n // shape[0]), shared_mem),)
    # Programmatic dependent launch in CUDA graphs: an eager step is bound by its launches, which the
    # ctypes path makes slower
    cuda_launch.launch(kern, grid, THREADS, args, shared_mem, vec.device, pdl=PDL and torch.cuda.is_current_stream_capturing())
    return out
