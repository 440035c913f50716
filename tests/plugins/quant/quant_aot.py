"""Compile runtime-plugin-quant's 4/8-bit kernels for an H100 (sm_90) without a GPU.

Run as a script with ``TRITON_INTERPRET`` unset (see ``tests/kernels/kernel_aot.py``, whose
compile helper this uses): ``python tests/plugins/quant/quant_aot.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
from kernel_aot import compile_for_sm90  # noqa: E402

from runtime_quant import jit_gemm, jit_wna16  # noqa: E402
from runtime_quant.scheme import FP8, MIN_SCALE, quant_max  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "lock_ptr": "*i32", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
            "residual_out_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"}


def signature(fn, constants: dict, pointers: dict) -> dict:
    return {name: pointers.get(name, "i32") for name in fn.arg_names if name not in constants}


def main() -> None:
    for fn, constants, warps in (
        (jit_wna16.wna16_gemv_kernel, dict(BITS=4, SPLIT_K=16, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=128, BLOCK_K=128), 4),
        (jit_wna16.wna16_gemm_kernel, dict(BITS=4, HAS_BIAS=False, IEEE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128), 4),
        (jit_wna16.wna16_dequantize_kernel, dict(BITS=4, BLOCK_N=64, BLOCK_K=128), 4),
        (jit_wna16.wna16_dequantize_kernel, dict(BITS=8, BLOCK_N=64, BLOCK_K=64), 4),
    ):
        compile_for_sm90(fn, signature(fn, constants, POINTERS), constants, num_warps=warps)
    # the RMSNorm and SiLU-and-mul that quantize their rows for the FP8 layer after them (Llama-3-8B's widths)
    fp8 = dict(QMAX=quant_max(FP8), MIN_SCALE=MIN_SCALE)
    for fn, constants, warps in (
        (jit_gemm.rms_norm_quantize_kernel, dict(HAS_RESIDUAL=True, GEMMA=False, BLOCK_N=4096, **fp8), 16),
        (jit_gemm.silu_and_mul_quantize_kernel, dict(BLOCK=16384, **fp8), 16),
    ):
        compile_for_sm90(fn, signature(fn, constants, POINTERS), constants, num_warps=warps)
    print("all quant kernels compiled for sm_90")


if __name__ == "__main__":
    main()
