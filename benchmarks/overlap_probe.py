"""Do decode attention and prefill matmuls overlap when issued on two CUDA streams? (GPU only)

Times, for one Llama-3.1-8B layer in bf16: the unified attention kernel over a decode
batch (``--decodes`` requests of ``--context`` tokens), the layer's four matmuls over
``--prefill`` rows, each alone, one after the other on one stream, and on two streams at
once. If the two-stream time is close to the larger of the two, a memory-bound decode
attention can hide compute-bound prefill matmuls.

    python3 benchmarks/overlap_probe.py --decodes 256 --context 1500 --prefill 256 512 1024
"""

from __future__ import annotations

import argparse
import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

import runtime_kernels.attention as attn  # noqa: E402
from cuda_timing import cuda_ms  # noqa: E402
from tune_attention import make_case  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD = 4096, 14336, 32, 8, 128


def layer_weights():
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN), (HIDDEN, HEADS * HEAD), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return [torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.01 for shape in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decodes", type=int, default=256)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--prefill", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--carveout", type=int, nargs="+", default=[0], help="SMs kept from cuBLAS matmuls")
    args = parser.parse_args()

    q, kv, table, qsl, seq_lens, kv_bytes = make_case(args.decodes, args.context, HEADS, KV_HEADS, HEAD)
    out = torch.empty_like(q)
    qkv_w, o_w, gate_up_w, down_w = layer_weights()
    side = torch.cuda.Stream()

    def attention():
        attn.unified_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, 1, HEAD**-0.5, max_seq_len=args.context)

    attn_ms = cuda_ms(attention)
    print(f"decode attention {args.decodes}x{args.context}: {attn_ms * 1000:.1f} us ({kv_bytes / attn_ms / 1e6:.0f} GB/s)")
    print(f"{'SMs kept':>8} {'rows':>6} {'matmuls us':>11} {'serial us':>10} {'2 streams us':>13} {'hidden':>7}")
    for carveout, rows in itertools.product(args.carveout, args.prefill):
        torch._C._set_sm_carveout_experimental(carveout or None)
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        h = torch.randn(rows, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")

        def matmuls():
            x @ qkv_w.T
            x @ o_w.T
            x @ gate_up_w.T
            h @ down_w.T

        def serial():
            attention()
            matmuls()

        def concurrent():  # matmuls first: their blocks take their SMs, attention fills the rest
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                matmuls()
            attention()
            torch.cuda.current_stream().wait_stream(side)

        mm_ms, serial_ms, both_ms = cuda_ms(matmuls), cuda_ms(serial), cuda_ms(concurrent)
        hidden = (serial_ms - both_ms) / min(attn_ms, mm_ms)
        print(f"{carveout:8d} {rows:6d} {mm_ms * 1000:11.1f} {serial_ms * 1000:10.1f} {both_ms * 1000:13.1f} {100 * hidden:6.0f}%")


if __name__ == "__main__":
    main()
