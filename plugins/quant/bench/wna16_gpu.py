"""GPU: the Triton weight-only kernels on Llama-3-8B's linear layers vs bf16 cuBLAS.

Random 4-bit (or 8-bit) weights in groups of 128 in the canonical packed layout; for each
batch size prints microseconds per call of each layer shape, for the packed kernel
(``triton_wna16``: the GEMV up to 4 rows, else the GEMM) and ``torch.nn.functional.linear``
on the dequantized bf16 weight, the packed kernel's effective bandwidth (bytes of packed
weights, scales and zero points read once, per second), and the sum over one decoder
layer times 32 layers (the per-token linear time of the 8B model at batch 1).

    python plugins/quant/bench/wna16_gpu.py [--bits 4] [--group 128] [--batches 1,4,16,64,256] [--sweep] [--one-row]

Times are taken inside a CUDA graph (as decode runs), so launch overhead does not count.
``--sweep`` also times every GEMV tiling of a grid for the decode batches (<= 4 rows) and
prints the fastest per shape next to the one :func:`runtime_quant.wna16_gpu.gemv_config` picks.
``--one-row`` compares, at one row and 4 bits, the Triton GEMV and the CUDA one (``runtime_quant.w4a16_cuda``), on copies of each layer rotated past the L2 cache;
``--one-row --clusters``: the CUDA one's default variant with and without thread block clusters.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from torch import nn

from runtime_quant.packing import pack, unpack
from runtime_quant.wna16_cpu import dequantize_codes
from runtime_quant.wna16_gpu import GEMV_MAX_ROWS, GemvConfig, gemv_config, triton_wna16, wna16_gemv
from runtime_quant.wna16_scheme import WNA16Scheme

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
NUM_LAYERS = 32


def packed_layer(in_features: int, out_features: int, scheme: WNA16Scheme) -> nn.Module:
    layer = nn.Module()
    layer.in_features = in_features
    layer.quant_group_rows = scheme.rows_per_group(in_features)
    layer.quant_bits = scheme.bits
    groups = scheme.groups(in_features)
    codes = torch.randint(0, 1 << scheme.bits, (in_features, out_features), dtype=torch.uint8, device="cuda")
    layer.qweight = pack(codes, scheme.bits, dim=0)
    layer.scales = torch.rand(groups, out_features, device="cuda") * 0.01
    layer.zeros = torch.randint(0, 1 << scheme.bits, (groups, out_features), dtype=torch.uint8, device="cuda")
    return layer


def cuda_time(fn, repeats: int = 20, replays: int = 10) -> float:
    """Microseconds per call: ``repeats`` calls captured in one CUDA graph, replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / (repeats * replays) * 1e3


def sweep(layers: dict, bits: int, batches: list[int]) -> None:
    """Every tiling of a small grid per decode shape: the fastest against the chosen one."""
    for batch in (b for b in batches if b <= GEMV_MAX_ROWS):
        for name, layer in layers.items():
            k, n = layer.in_features, layer.qweight.shape[1]
            x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
            chosen = gemv_config(n, k, layer.quant_group_rows, x.device)
            timings = {}
            for block_n, block_k, split, warps in itertools.product((64, 128, 256), (32, 64, 128), (8, 16, 32, 64), (2, 4, 8)):
                config = GemvConfig(block_n, block_k, split, warps)
                timings[config] = cuda_time(lambda: wna16_gemv(layer, bits, x, None, config), repeats=10, replays=5)
            best = sorted(timings, key=timings.get)[:3]
            nbytes = layer.qweight.numel() * 4 + layer.scales.numel() * 4 + layer.zeros.numel()
            chosen_us = cuda_time(lambda: wna16_gemv(layer, bits, x, None, chosen))
            print(f"sweep batch {batch} {name:8s}: chosen {chosen} {chosen_us:7.1f} us "
                  f"({nbytes / chosen_us / 1e3:6.0f} GB/s); best " +
                  "; ".join(f"{c} {timings[c]:7.1f} us ({nbytes / timings[c] / 1e3:6.0f} GB/s)" for c in best), flush=True)


def compare_one_row(scheme: WNA16Scheme, l2_bytes: int = 120 << 20, rows: int = 1, clusters: bool = False,
                    chunks: tuple[int, ...] = (8, 16)) -> None:
    """``rows`` rows (1 by default), 4 bits: the Triton GEMV against the CUDA one
    (:mod:`runtime_quant.w4a16_cuda`, ``chunks`` chunks per block; with ``clusters``, its default variant
    with and without thread block clusters instead), per shape and for all linears x 32 layers, each call
    on the next of enough layer copies that none is still in L2."""
    from runtime_quant import w4a16_cuda
    from runtime_quant.wna16_gpu import _locks

    shapes = w4a16_cuda.VARIANTS if rows == 1 else (w4a16_cuda.MULTI_ROW, dataclasses.replace(w4a16_cuda.MULTI_ROW, min_blocks=1))
    variants = [dataclasses.replace(v, chunks_per_block=c) for v in shapes for c in chunks]
    if clusters:
        variants = [w4a16_cuda.variant_for(rows)]

    def clustered(on: bool, run):
        def go(c):
            saved, w4a16_cuda.CLUSTERS = w4a16_cuda.CLUSTERS, on
            try:
                return run(c)
            finally:
                w4a16_cuda.CLUSTERS = saved
        return go

    totals = {}
    for name, (k, n) in SHAPES.items():
        first = packed_layer(k, n, scheme)
        nbytes = first.qweight.numel() * 4 + first.scales.numel() * 4 + first.zeros.numel()
        copies = [first] + [packed_layer(k, n, scheme) for _ in range(max(1, -(-l2_bytes // nbytes)) - 1)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        chosen = gemv_config(n, k, first.quant_group_rows, x.device)
        locks = _locks(x.device)
        runs = {
            "triton": lambda c: wna16_gemv(c, 4, x, None, chosen),
            **{f"cuda {v.columns}c/{v.min_blocks}b/{v.chunks_per_block}k": (lambda c, v=v: w4a16_cuda.gemv(c, x, None, locks, v))
               for v in variants},
        }
        if clusters:
            plain = runs.pop(next(label for label in runs if label.startswith("cuda")))
            runs.update({"cuda global sum": clustered(False, plain), "cuda clusters": clustered(True, plain)})
        ref = dequantize_codes(first, unpack(first.qweight, 4, dim=0), 0)
        ref = (x.float() @ ref.cuda()).float()
        line = []
        for label, run in runs.items():
            err = (run(first).float() - ref).abs().max().item() / ref.abs().max().item()
            us = cuda_time(lambda: [run(c) for c in copies], repeats=4, replays=5) / len(copies)
            totals[label] = totals.get(label, 0.0) + us
            line.append(f"{label} {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s, err {err:.1e})")
        print(f"{rows}-row {name:8s} [{k}x{n}]: " + "; ".join(line), flush=True)
    print(f"{rows}-row all linears x 32 layers: " + ", ".join(f"{label} {us * NUM_LAYERS / 1e3:.3f} ms" for label, us in totals.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time a grid of GEMV tilings per decode shape")
    parser.add_argument("--sweep-batches", default="1")
    parser.add_argument("--one-row", action="store_true", help="compare the one-row 4-bit GEMVs (Triton, CUDA), then exit")
    parser.add_argument("--rows", type=int, default=1, help="rows of x for --one-row (1-4)")
    parser.add_argument("--chunks", default="8,16", help="chunks a block for --one-row's CUDA variants")
    parser.add_argument("--clusters", action="store_true",
                        help="with --one-row: the default CUDA variant with and without thread block clusters")
    args = parser.parse_args()
    scheme = WNA16Scheme("gptq", args.bits, args.group, symmetric=False)
    if args.one_row:
        compare_one_row(WNA16Scheme("gptq", 4, args.group, symmetric=False), rows=args.rows, clusters=args.clusters,
                        chunks=tuple(int(c) for c in args.chunks.split(",")))
        return
    layers = {name: packed_layer(i, o, scheme) for name, (i, o) in SHAPES.items()}
    dense = {name: dequantize_codes(layer, unpack(layer.qweight, args.bits, dim=0), 0).t().to(torch.bfloat16).contiguous()
             for name, layer in layers.items()}  # [out, in] as F.linear takes it
    batches = [int(b) for b in args.batches.split(",")]
    if args.sweep:
        sweep(layers, args.bits, [int(b) for b in args.sweep_batches.split(",")])
    for batch in batches:
        total_packed = total_dense = 0.0
        for name, (i, o) in SHAPES.items():
            x = torch.randn(batch, i, device="cuda", dtype=torch.bfloat16)
            layer = layers[name]
            err = (triton_wna16(layer, scheme, x, None).float() - x.float() @ dense[name].float().t()).abs().max()
            packed = cuda_time(lambda: triton_wna16(layer, scheme, x, None))
            cublas = cuda_time(lambda: torch.nn.functional.linear(x, dense[name]))
            nbytes = layer.qweight.numel() * 4 + layer.scales.numel() * 4 + layer.zeros.numel()
            total_packed += packed
            total_dense += cublas
            print(f"batch {batch:4d} {name:8s} [{i}x{o}]: packed {packed:8.1f} us ({nbytes / packed / 1e3:7.1f} GB/s), "
                  f"bf16 {cublas:8.1f} us, max |diff| {err:.3g}")
        print(f"batch {batch:4d} all linears x {NUM_LAYERS} layers: packed {total_packed * NUM_LAYERS / 1e3:.2f} ms, "
              f"bf16 {total_dense * NUM_LAYERS / 1e3:.2f} ms\n")


if __name__ == "__main__":
    main()
