"""GPU: the fp8 method's decode-batch pieces on Llama-3-8B's linear layers, against bf16 cuBLAS.

For ``--rows`` activation rows (256: W2's decode batch) prints, per layer shape, microseconds per
call of the activation quantizer (the fp8 method's one Triton launch, at each ``num_warps`` of
``--warps``, its output buffers included), of cuBLASLt's FP8 GEMM with row-wise scales (``torch._scaled_mm``) and of bf16
``F.linear``, with the GEMMs' TFLOP/s, and the sum over one step of the 8B model (x 32 layers).

    python plugins/quant/bench/fp8_gpu.py [--rows 256] [--warps 4,8,16]

Times are taken inside a CUDA graph (as decode runs), so launch overhead does not count.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from runtime_quant.gpu import _row_quantize
from runtime_quant.scheme import FP8, MIN_SCALE, quant_max

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NUM_LAYERS = 32


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--warps", default="4,8,16")
    args = parser.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    totals: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
        w16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        scale_w = (w16.float().abs().amax(dim=1) / quant_max(FP8)).clamp(min=MIN_SCALE)
        w8 = (w16.float() / scale_w[:, None]).to(FP8)
        line = [f"{name:<8} {n:>6} x {k:<6}"]
        for nw in warps:
            us = graph_us(lambda nw=nw: _row_quantize(x, FP8, num_warps=nw))
            totals[f"quantize w{nw}"] = totals.get(f"quantize w{nw}", 0.0) + us * NUM_LAYERS
            line.append(f"quantize w{nw} {us:6.1f}")
        codes, scales = _row_quantize(x, FP8)
        flop = 2 * args.rows * n * k
        mm = graph_us(lambda: torch._scaled_mm(codes, w8.t(), scale_a=scales, scale_b=scale_w.view(1, n),
                                               out_dtype=torch.bfloat16))
        bf = graph_us(lambda: F.linear(x, w16))
        totals["fp8 mm"] = totals.get("fp8 mm", 0.0) + mm * NUM_LAYERS
        totals["bf16 mm"] = totals.get("bf16 mm", 0.0) + bf * NUM_LAYERS
        line.append(f"fp8 mm {mm:6.1f} ({flop / mm / 1e6:5.0f} TFLOP/s)  bf16 {bf:6.1f} ({flop / bf / 1e6:5.0f} TFLOP/s)")
        print("  ".join(line), flush=True)
    print(f"per step of the 8B model at {args.rows} rows (ms): " + ", ".join(f"{k} {v / 1000:.3f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
