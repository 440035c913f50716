"""Sweep the launch shape of the unified attention kernel on decode batches (GPU only).

For each case (requests x context, Qwen3-0.6B / Llama-8B head layout, bf16, 16-token
blocks) times ``unified_attention`` with every (tile_n, num_warps, num_stages) in the
grid, and prints the achieved KV read bandwidth next to the current default.

    python3 benchmarks/tune_attention.py
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

import runtime_kernels.attention as attn  # noqa: E402
from cuda_timing import cuda_ms  # noqa: E402

CASES = [  # (label, num_reqs, context, num_heads, num_kv_heads, head_size)
    ("W1 decode 256x840", 256, 840, 16, 8, 128),
    ("W3 decode 1x400", 1, 400, 32, 8, 128),
]
BLOCK_SIZE = 16


def make_case(num_reqs, context, num_heads, num_kv_heads, head_size):
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req + 1
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(num_blocks - 1, device="cuda")[: num_reqs * blocks_per_req] + 1
    table = perm.view(num_reqs, blocks_per_req).to(torch.int32)
    q = torch.randn(num_reqs, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * num_reqs * context * num_kv_heads * head_size * 2
    return q, kv, table, qsl, seq_lens, kv_bytes


def main() -> None:
    default_tiles = attn.attention_tiles
    for label, num_reqs, context, heads, kv_heads, head in CASES:
        q, kv, table, qsl, seq_lens, kv_bytes = make_case(num_reqs, context, heads, kv_heads, head)
        out = torch.empty_like(q)

        def run():
            attn.unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, 1, head**-0.5, max_seq_len=context)

        results = []
        for tile_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)):
            def tiles(max_query_len, group, head_size, tile_n=tile_n, warps=warps, stages=stages):
                base = default_tiles(max_query_len, group, head_size)
                return attn.AttentionTiles(base.block_m, base.block_q, tile_n, warps, stages)

            attn.attention_tiles = tiles
            try:
                ms = cuda_ms(run)
            except Exception as exc:  # out of shared memory and the like
                print(f"  {label}: tile_n={tile_n} warps={warps} stages={stages} failed: {type(exc).__name__}")
                continue
            finally:
                attn.attention_tiles = default_tiles
            results.append((ms, tile_n, warps, stages))
        base_ms = cuda_ms(run)
        results.sort()
        print(f"{label}: default {base_ms * 1000:.1f} us ({kv_bytes / base_ms / 1e6:.0f} GB/s)")
        for ms, tile_n, warps, stages in results[:4]:
            print(f"   tile_n={tile_n:<4} warps={warps} stages={stages}: {ms * 1000:.1f} us ({kv_bytes / ms / 1e6:.0f} GB/s)")


if __name__ == "__main__":
    main()
