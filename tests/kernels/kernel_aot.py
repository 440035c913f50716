"""Compile every kernel of runtime-kernels for an H100 (sm_90) without a GPU.

Run as a script with ``TRITON_INTERPRET`` unset (Triton cannot switch modes inside one
process): ``python tests/kernels/kernel_aot.py``. Exits non-zero on the first error.
"""

from __future__ import annotations

import importlib

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(fn, signature: dict, constants: dict, num_warps: int = 4) -> None:
    signature = {**signature, **{name: "constexpr" for name in constants}}
    kernel = triton.compile(ASTSource(fn, signature, constants), target=TARGET, options={"num_warps": num_warps})
    assert kernel.asm["cubin"]


def attention_signature(dtype: str, cache: str | None = None) -> dict:
    cache = cache or dtype
    sig = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "out_ptr": f"*{dtype}",
           "partial_ptr": "*fp32", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
           "scale": "fp32", "softcap": "fp32", "window": "i32", "num_reqs": "i32"}
    strides = ["q_tok", "q_head", "o_tok", "o_head", "k_block", "k_slot", "k_head", "v_block", "v_slot", "v_head", "table"]
    return sig | {f"stride_{s}": "i32" for s in strides}


def compile_attention(dtype, head, group, block_m, window, softcap, segments, cache=None, decode=False,
                      slot_minor=False):
    from runtime_kernels.jit import attention as jit

    f16_dots = cache == "fp8e4nv"
    tile_n = 64 if slot_minor or not (f16_dots and decode) else 128  # attention_tiles' choice
    constants = dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head, HEAD_PAD=head, BLOCK_SIZE=16, BLOCK_Q=block_m // group,
                     BLOCK_M=block_m, TILE_N=tile_n, USE_WINDOW=window, USE_SOFTCAP=softcap,
                     DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False, F16_DOTS=f16_dots,
                     NUM_SEGMENTS=segments, DECODE=decode, V_SLOT_MINOR=slot_minor)
    compile_for_sm90(jit.unified_attention_kernel, attention_signature(dtype, cache), constants,
                     num_warps=1 if slot_minor and decode else 4)
    if segments > 1:
        sig = {"partial_ptr": "*fp32", "out_ptr": f"*{dtype}", "stride_o_tok": "i32", "stride_o_head": "i32"}
        compile_for_sm90(jit.merge_segments_kernel, sig, dict(HEAD_SIZE=head, HEAD_PAD=head, NUM_SEGMENTS=segments))


def compile_elementwise():
    load = importlib.import_module
    strides = ["q_tok", "q_head", "k_tok", "k_head", "v_tok", "v_head", "kc_block", "kc_slot", "kc_head", "vc_block",
               "vc_slot", "vc_head", "cos_sin"]
    # the plain write, the rotating one, and the 8-bit cache's with slot-minor values
    for rotate, cache, slot_minor in ((False, "bf16", False), (True, "bf16", False), (True, "fp8e4nv", True)):
        sig = {"positions_ptr": "*i64", "q_ptr": "*bf16", "key_ptr": "*bf16", "value_ptr": "*bf16",
               "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32",
               "num_q_heads": "i32", "num_kv_heads": "i32"} | {f"stride_{s}": "i32" for s in strides}
        compile_for_sm90(load("runtime_kernels.jit.kv_cache").reshape_and_cache_kernel, sig,
                         dict(ROTATE=rotate, HEAD_SIZE=128, HALF=64, HALF_PAD=64, HEAD_PAD=128, Q_HEADS_PAD=32,
                              HEADS_PAD=8, BLOCK_SIZE=16, V_SLOT_MINOR=slot_minor))
    sig = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "residual_out_ptr": "*bf16",
           "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "hidden": "i32", "eps": "fp32"}
    compile_for_sm90(load("runtime_kernels.jit.norm").rms_norm_kernel, sig, dict(HAS_RESIDUAL=True, GEMMA=False, BLOCK_N=1024))
    sig = {"positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cos_sin_ptr": "*fp32", "stride_q_tok": "i32",
           "stride_q_head": "i32", "stride_k_tok": "i32", "stride_k_head": "i32", "stride_cache": "i32",
           "num_q_heads": "i32", "num_k_heads": "i32"}
    compile_for_sm90(load("runtime_kernels.jit.rotary").rotary_kernel, sig,
                     dict(HALF=64, HALF_PAD=64, Q_HEADS_PAD=16, K_HEADS_PAD=8))
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32", "d": "i32"}
    compile_for_sm90(load("runtime_kernels.jit.activation").silu_and_mul_kernel, sig, dict(BLOCK=1024))
    sig = {"logits_ptr": "*bf16", "bitmask_ptr": "*i32", "rows_ptr": "*i64", "slots_ptr": "*i32", "vocab_size": "i32",
           "num_words": "i32", "stride_logits": "i32", "stride_bitmask": "i32"}
    compile_for_sm90(load("runtime_kernels.jit.bitmask").apply_token_bitmask_kernel, sig,
                     dict(HAS_ROWS=True, HAS_SLOTS=True, BLOCK=2048))
    argmax = load("runtime_kernels.jit.argmax")
    sig = {"logits_ptr": "*fp32", "values_ptr": "*fp32", "indices_ptr": "*i64", "vocab": "i32", "stride_row": "i32"}
    compile_for_sm90(argmax.argmax_chunks_kernel, sig, dict(CHUNK=4096, NUM_CHUNKS=32))
    sig = {"values_ptr": "*fp32", "indices_ptr": "*i64", "out_ptr": "*i64"}
    compile_for_sm90(argmax.argmax_rows_kernel, sig, dict(NUM_CHUNKS=32, CHUNKS_PAD=32))


def compile_gemv():
    """The plain one-row gemv, its prologue variants and the gated one (with and without the norm), 16- and
    8-bit weights, each kind of launch shape."""
    from runtime_kernels.jit.gemv import gemv_kernel

    norm_args = {"residual_ptr": "*bf16", "norm_w_ptr": "*bf16", "residual_out_ptr": "*bf16", "eps": "fp32"}
    unused = dict.fromkeys(norm_args)  # None: what a launch without the norm passes
    for weight, block_k, row_sums in (("bf16", 512, False), ("fp8e4nv", 2048, True)):
        sig = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
               "N": "i32", "K": "i32", "stride_w": "i32"}
        launch = dict(HAS_SCALE=weight != "bf16", HAS_BIAS=True, BLOCK_N=2 if row_sums else 8, BLOCK_K=block_k,
                      ROW_SUMS=row_sums, HAS_RESIDUAL=False, GEMMA=False, GATED=False)
        compile_for_sm90(gemv_kernel, sig, dict(launch, PROLOGUE=0, **unused))
        compile_for_sm90(gemv_kernel, sig, dict(launch, PROLOGUE=1, **unused))
        compile_for_sm90(gemv_kernel, sig, dict(launch, PROLOGUE=0, GATED=True, **unused))
        for residual, gemma in ((True, False), (False, True)):
            compile_for_sm90(gemv_kernel, sig | norm_args, dict(launch, PROLOGUE=2, HAS_RESIDUAL=residual, GEMMA=gemma))
        compile_for_sm90(gemv_kernel, sig | norm_args, dict(launch, PROLOGUE=2, HAS_RESIDUAL=True, GATED=True))


if __name__ == "__main__":
    compile_attention("bf16", 128, 2, 16, False, False, 8, decode=True)
    compile_attention("bf16", 128, 4, 16, True, False, 1, decode=True)  # decode with a window
    compile_attention("bf16", 128, 4, 32, False, False, 4)  # speculative verification: 1 + k queries, split-KV
    compile_attention("fp32", 64, 3, 64, True, True, 1)
    compile_attention("bf16", 128, 4, 16, False, True, 1, cache="fp8e4nv")
    compile_attention("bf16", 128, 4, 16, False, False, 1, cache="fp8e4nv", decode=True, slot_minor=True)  # W2's FP8 decode
    compile_attention("bf16", 128, 4, 16, False, False, 1, cache="fp8e4nv", decode=True)  # ... with the usual values
    compile_attention("bf16", 128, 4, 128, True, False, 1, cache="fp8e4nv", slot_minor=True)  # FP8 prefill (128 rows)
    compile_elementwise()
    compile_gemv()
    print("all kernels compiled for sm_90")
