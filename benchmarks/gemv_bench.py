"""One-row linear layers of a batch-1 decode step: runtime_kernels' gemv against cuBLAS (GPU only).

Times ``gemv(x, W)`` (autotuned on first use) and ``F.linear(x, W)`` for the projection
shapes of a Llama-3.1-8B layer and its logits, bf16, and prints the weight read rate.

    python3 benchmarks/gemv_bench.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime_kernels.gemv import gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "logits": (128256, 4096)}
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "logits": 1}  # calls per decode step


def time_us(fn, iters: int = 200) -> float:
    for _ in range(5):
        fn()
    graph = torch.cuda.CUDAGraph()  # replay many calls so launch overhead does not count
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    totals = {"gemv": 0.0, "cublas": 0.0}
    print(f"{'layer':<8} {'N x K':>14} {'gemv us':>9} {'GB/s':>6} {'cuBLAS us':>10} {'GB/s':>6}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(gemv(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)
        ours, theirs = time_us(lambda: gemv(x, w)), time_us(lambda: F.linear(x, w))
        gb = w.numel() * 2 / 1e3
        totals["gemv"] += ours * PER_TOKEN[name]
        totals["cublas"] += theirs * PER_TOKEN[name]
        print(f"{name:<8} {n:>6} x {k:<6} {ours:>9.1f} {gb / ours:>6.0f} {theirs:>10.1f} {gb / theirs:>6.0f}")
    print(f"per decode step of the 8B model: gemv {totals['gemv'] / 1000:.3f} ms, cuBLAS {totals['cublas'] / 1000:.3f} ms")


if __name__ == "__main__":
    main()
