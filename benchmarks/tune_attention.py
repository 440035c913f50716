"""Sweep the launch shape of the unified attention kernel (GPU only).

For each case (requests x query tokens x context, Qwen3-0.6B / Llama-8B head layout,
bf16 or FP8 cache, 16-token blocks by default) times ``unified_attention`` with every (block_m, tile_n,
num_warps, num_stages) in the grid, and prints the achieved KV read bandwidth (decode
cases) or FLOP rate (prefill cases, causal) next to the current default.

    python3 benchmarks/tune_attention.py [--block-size 32] [--layout HND]

``--layout HND`` stores each block's slots head by head (the kernel reads it through its strides), to see
whether the engine's slot-major layout costs bandwidth; ``--layout slot-minor-values`` stores the values of
each block as ``[kv heads, head, slots]`` (``runtime_kernels.kv_cache.slot_minor``,
what the engine does to an 8-bit cache unless ``RUNTIME_FP8_V_SLOT_MINOR=0``).
"""

from __future__ import annotations

import argparse
import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

import runtime_kernels.attention as attn  # noqa: E402
from runtime_kernels.kv_cache import slot_minor  # noqa: E402
from cuda_timing import cuda_ms  # noqa: E402

CASES = {  # label: (num_reqs, query tokens per request, context, num_heads, num_kv_heads, head_size, cache dtype)
    "W1 decode 256x840": (256, 1, 840, 16, 8, 128, torch.bfloat16),
    "W3 decode 1x400": (1, 1, 400, 32, 8, 128, torch.bfloat16),
    "W2 decode 256x1500": (256, 1, 1500, 32, 8, 128, torch.bfloat16),
    "W2 decode 256x1500 fp8 cache": (256, 1, 1500, 32, 8, 128, torch.float8_e4m3fn),
    "W2 prefill 8x1000": (8, 1000, 1000, 32, 8, 128, torch.bfloat16),
    "W2 prefill 16x1000 fp8 cache": (16, 1000, 1000, 32, 8, 128, torch.float8_e4m3fn),
    "W1 prefill 16x512": (16, 512, 512, 16, 8, 128, torch.bfloat16),
}


def make_case(num_reqs, context, num_heads, num_kv_heads, head_size, query_len=1, cache_dtype=torch.bfloat16,
              layout="NHD", block_size=16):
    blocks_per_req = -(-context // block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    # HND: each head's slots of a block contiguous in memory, seen through the kernels' strides
    head_major = layout in ("HND", "head-major-keys")
    inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
    kv = torch.randn(2, num_blocks, *inner, head_size, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    if head_major:
        kv = kv.transpose(2, 3)
    perm = torch.randperm(num_blocks - 1, device="cuda")[: num_reqs * blocks_per_req] + 1
    table = perm.view(num_reqs, blocks_per_req).to(torch.int32)
    q = torch.randn(num_reqs * query_len, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda") * query_len
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * num_reqs * context * num_kv_heads * head_size * kv.element_size()
    return q, kv, table, qsl, seq_lens, kv_bytes


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--segments", default="", help="comma-separated split-KV segment counts to try (decode cases; default: the launcher's choice)")
    parser.add_argument("--tile-n", default="32,64,128,256")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--layout", choices=("NHD", "HND", "slot-minor-values", "head-major-keys"), default="NHD",
                        help="the cache's order within a block: slots then heads (the engine's), heads then slots, "
                             "the values' slots last, or keys heads then slots with the values' slots last")
    parser.add_argument("--block-size", type=int, default=16, help="cache slots a block (the engine's default: 16)")
    args = parser.parse_args()
    default_tiles = attn.attention_tiles
    for label in args.cases:
        num_reqs, query_len, context, heads, kv_heads, head, cache_dtype = CASES[label]
        q, kv, table, qsl, seq_lens, kv_bytes = make_case(num_reqs, context, heads, kv_heads, head, query_len, cache_dtype,
                                                           args.layout, args.block_size)
        out = torch.empty_like(q)
        values = kv[1]
        if args.layout in ("slot-minor-values", "head-major-keys"):
            values = slot_minor(torch.empty(kv[1].shape, dtype=kv.dtype, device=kv.device))
            values.copy_(kv[1])
        # causal prefill from position 0: q_len * (q_len + 1) / 2 scores per head, 4 * head FLOPs each
        flops = num_reqs * heads * query_len * (query_len + 1) // 2 * 4 * head

        def run(segments=None):
            attn.unified_attention(q, kv[0], values, out, qsl, seq_lens, table, query_len, head**-0.5, max_seq_len=context,
                                   num_segments=segments)

        def rate(ms):
            return f"{kv_bytes / ms / 1e6:.0f} GB/s" if query_len == 1 else f"{flops / ms / 1e9:.0f} TFLOP/s"

        block_ms = (None,) if query_len == 1 else (32, 64, 128)
        results = []
        segment_options = (ints(args.segments) or (None,)) if query_len == 1 else (None,)
        for block_m, tile_n, warps, stages, segments in itertools.product(
            block_ms, ints(args.tile_n), ints(args.warps), ints(args.stages), segment_options
        ):
            def tiles(max_query_len, group, head_size, cache_bytes=2, values_slot_minor=False, block_m=block_m,
                      tile_n=tile_n, warps=warps, stages=stages):
                base = default_tiles(max_query_len, group, head_size, cache_bytes, values_slot_minor)
                rows = block_m or base.block_m
                return attn.AttentionTiles(rows, rows // group, tile_n, warps, stages)

            attn.attention_tiles = tiles
            try:
                ms = cuda_ms(lambda segments=segments: run(segments))
            except Exception as exc:  # out of shared memory and the like
                print(f"  {label}: block_m={block_m} tile_n={tile_n} warps={warps} stages={stages} failed: {type(exc).__name__}")
                continue
            finally:
                attn.attention_tiles = default_tiles
            results.append((ms, block_m, tile_n, warps, stages, segments))
        base_ms = cuda_ms(run)
        results.sort(key=lambda r: r[0])
        print(f"{label}: default {base_ms * 1000:.1f} us ({rate(base_ms)})")
        for ms, block_m, tile_n, warps, stages, segments in results[:args.top]:
            print(f"   block_m={block_m} tile_n={tile_n:<4} warps={warps} stages={stages}"
                  f"{f' segments={segments}' if segments else ''}: "
                  f"{ms * 1000:.1f} us ({rate(ms)})")


if __name__ == "__main__":
    main()
