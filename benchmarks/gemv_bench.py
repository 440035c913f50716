"""One-row linear layers of a batch-1 decode step: runtime_kernels' gemv against cuBLAS (GPU only).

Times ``gemv(x, W)`` (autotuned on first use) and ``F.linear(x, W)`` for the projection
shapes of a Llama-3.1-8B layer and its logits, and prints the weight read rate. With
``--dtype fp8`` the weights are FP8 codes with one float32 scale per row (the fp8 quant
method's batch-1 path), the peer still bf16 cuBLAS; ``--sweep`` times every launch shape of
a wider grid per layer and prints the fastest next to the autotuner's choice. ``--fused`` times
the layers that follow a norm (q/k/v, gate/up) or the SiLU activation (down) with that op fused
into the gemv's prologue against the two launches it replaces. On a GPU where it compiles, ``gemv``
is the CUDA kernel (``RUNTIME_GEMV_CUDA=0``: the Triton one); ``--cuda-shapes`` times each of its
row shapes (rows a warp, stretches in flight) per layer; ``--gated`` times gate/up storing the SiLU of its
product against the plain gemv with and without the ``silu_and_mul`` kernel after it.

    python3 benchmarks/gemv_bench.py [--dtype fp8] [--sweep | --fused | --cuda-shapes | --gated]
"""

from __future__ import annotations

import argparse
import itertools
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


def sweep(x, w, scale, out) -> list[tuple[float, str]]:
    from runtime_kernels.jit.gemv import gemv_kernel

    n, k = w.shape
    results = []
    for block_n, block_k, warps, stages, row_sums in itertools.product(
        (2, 4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8), (1, 3), (False, True)
    ):
        if block_n * block_k > 32768 or block_k > k:
            continue
        args = (x[0], w, scale if scale is not None else out, out, out, n, k, w.stride(0))
        grid = (-(-n // block_n),)

        def call(args=args, grid=grid, bn=block_n, bk=block_k, nw=warps, ns=stages, rs=row_sums):
            gemv_kernel[grid](*args, HAS_SCALE=scale is not None, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk,
                              ROW_SUMS=rs, num_warps=nw, num_stages=ns)

        try:
            results.append((time_us(call, 100), f"n{block_n} k{block_k} w{warps} s{stages}{' rowsums' if row_sums else ''}"))
        except Exception as exc:  # noqa: BLE001 - out of registers or shared memory
            results.append((float("inf"), f"n{block_n} k{block_k} w{warps} s{stages} failed {type(exc).__name__}"))
    return sorted(results)


def make_weight(name: str, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(bf16 weight, weight as the gemv reads it, row scales or None)`` of layer ``name``."""
    n, k = SHAPES[name]
    w16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    if not fp8 or name == "logits":  # the fp8 method leaves lm_head in 16 bits
        return w16, w16, None
    scale = (w16.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return w16, (w16.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


FUSED = {"qkv": "rms_norm", "gate_up": "rms_norm", "down": "silu_and_mul"}  # the op before each layer


def compare_fused(dtype: str) -> None:
    """Each layer after a norm or the activation: the fused gemv against the op's kernel then gemv."""
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.gemv import rms_norm_gemv, silu_and_mul_gemv
    from runtime_kernels.norm import fused_add_rms_norm

    saved = 0.0
    print(f"{dtype}: {'layer':<8} {'prologue':<13} {'fused us':>9} {'unfused us':>11}")
    for name, op in FUSED.items():
        _, w, scale = make_weight(name, dtype == "fp8")
        k = SHAPES[name][1]
        if op == "rms_norm":
            x, residual = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            norm_w = torch.rand(k, dtype=torch.bfloat16, device="cuda") + 0.5
            fused = lambda: rms_norm_gemv(x, residual, norm_w, 1e-5, False, w, None, scale)[0]  # noqa: E731
            unfused = lambda: gemv(fused_add_rms_norm(x, residual, norm_w, 1e-5)[0], w, scale=scale)  # noqa: E731
        else:
            x = torch.randn(1, 2 * k, dtype=torch.bfloat16, device="cuda")
            fused = lambda: silu_and_mul_gemv(x, w, None, scale)  # noqa: E731
            unfused = lambda: gemv(silu_and_mul(x), w, scale=scale)  # noqa: E731
        torch.testing.assert_close(fused(), unfused(), atol=2e-2, rtol=2e-2)
        ours, theirs = time_us(fused), time_us(unfused)
        saved += (theirs - ours) * PER_TOKEN[name]
        print(f"{dtype}: {name:<8} {op:<13} {ours:>9.1f} {theirs:>11.1f}")
    print(f"{dtype}: per decode step of the 8B model the prologues save {saved / 1000:.3f} ms")


def compare_gated(dtype: str) -> None:
    """gate/up's gemv storing ``silu(gate) * up`` (gated) against the plain gemv and against the plain gemv
    followed by the ``silu_and_mul`` kernel (the unfused pair), without the norm before it."""
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.gemv import _launch

    _, w, scale = make_weight("gate_up", dtype == "fp8")
    x = torch.randn(SHAPES["gate_up"][1], dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(_launch(x, w, None, scale, gated=True), silu_and_mul(_launch(x, w, None, scale)[None])[0],
                               atol=2e-2, rtol=2e-2)
    plain = time_us(lambda: _launch(x, w, None, scale))
    gated = time_us(lambda: _launch(x, w, None, scale, gated=True))
    apart = time_us(lambda: silu_and_mul(_launch(x, w, None, scale)[None])[0])
    print(f"{dtype}: gate_up plain {plain:.1f} us, gated {gated:.1f} us, plain + silu_and_mul {apart:.1f} us")


def cuda_shapes(dtype: str) -> None:
    from runtime_kernels import gemv_cuda

    totals = dict.fromkeys(gemv_cuda.SHAPES, 0.0)
    for name, (n, k) in SHAPES.items():
        _, w, scale = make_weight(name, dtype == "fp8")
        x = torch.randn(k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(n, dtype=x.dtype, device="cuda")
        gb = w.numel() * w.element_size() / 1e3
        row = []
        for shape in gemv_cuda.SHAPES:
            us = time_us(lambda shape=shape: gemv_cuda.gemv(x, w, None, scale, out, shape=shape))
            totals[shape] += us * PER_TOKEN[name]
            row.append(f"{shape[0]}x{shape[1]} {us:6.1f} us {gb / us:5.0f} GB/s")
        print(f"{dtype}: {name:<8} " + " | ".join(row))
    print(f"{dtype}: per decode step: " + ", ".join(f"{r}x{u} {t / 1000:.3f} ms" for (r, u), t in totals.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fused", action="store_true", help="time the norm and SiLU prologues instead")
    parser.add_argument("--cuda-shapes", action="store_true", help="time the CUDA kernel's row shapes instead")
    parser.add_argument("--gated", action="store_true", help="time gate/up with the SiLU as it stores instead")
    args = parser.parse_args()
    if args.fused:
        return compare_fused(args.dtype)
    if args.gated:
        return compare_gated(args.dtype)
    if args.cuda_shapes:
        return cuda_shapes(args.dtype)
    fp8 = args.dtype == "fp8"
    totals = {"gemv": 0.0, "cublas": 0.0, "best": 0.0}
    print(f"{args.dtype}: {'layer':<8} {'N x K':>14} {'gemv us':>9} {'GB/s':>6} {'cuBLAS bf16 us':>15} {'GB/s':>6}")
    for name, (n, k) in SHAPES.items():
        w16, w, scale = make_weight(name, fp8)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        if scale is not None:
            torch.testing.assert_close(gemv(x, w, scale=scale), F.linear(x, (w.float() * scale[:, None]).to(torch.bfloat16)),
                                       atol=3e-2, rtol=3e-2)
        else:
            torch.testing.assert_close(gemv(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)
        ours, theirs = time_us(lambda: gemv(x, w, scale=scale)), time_us(lambda: F.linear(x, w16))
        gb = w.numel() * w.element_size() / 1e3
        totals["gemv"] += ours * PER_TOKEN[name]
        totals["cublas"] += theirs * PER_TOKEN[name]
        print(f"{args.dtype}: {name:<8} {n:>6} x {k:<6} {ours:>9.1f} {gb / ours:>6.0f} {theirs:>15.1f} {gb * w16.element_size() / w.element_size() / theirs:>6.0f}")
        if args.sweep:
            out = torch.empty(n, dtype=x.dtype, device=x.device)
            ranked = sweep(x, w, scale, out)
            totals["best"] += ranked[0][0] * PER_TOKEN[name]
            for us, label in ranked[:5]:
                print(f"{args.dtype}:    sweep {name:<8} {label:<28} {us:8.1f} us {gb / us:6.0f} GB/s")
    print(f"{args.dtype}: per decode step of the 8B model: gemv {totals['gemv'] / 1000:.3f} ms, cuBLAS bf16 {totals['cublas'] / 1000:.3f} ms"
          + (f", best of the sweep {totals['best'] / 1000:.3f} ms" if args.sweep else ""))


if __name__ == "__main__":
    main()
