"""GPU time of a callable, from CUDA events (shared by the benchmark scripts)."""

from __future__ import annotations

import torch


def cuda_ms(fn, iters: int = 50, warmup: int = 3) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls, after ``warmup``."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
