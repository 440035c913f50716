"""GPU: the Triton GGUF kernels (blocks dequantized in the kernel) on Llama-3.1-8B's linear layers vs bf16 cuBLAS.

Random blocks of each ggml type (:func:`runtime_quant.gguf_blocks.random_blocks`) for every
layer shape; for each batch size prints microseconds per call of the packed kernel
(``gguf_matmul``: the GEMV up to 4 rows, else the dequantize-tile GEMM) and of
``torch.nn.functional.linear`` on the dequantized bf16 weight, the packed kernel's bandwidth
(bytes of blocks read once, per second), its largest difference from the bf16 result (relative
to the largest value), the sum over one decoder layer times 32 layers, and a table of those sums last.

    python plugins/quant/bench/gguf_gpu.py [--types Q4_0,Q4_K,...] [--batches 1,16,256] [--sweep] [--sweep-gemm]

Above 4 rows both large-batch paths are timed: the fused GEMM (``gguf_gemm``) and the layer
dequantized into the one-layer scratch then cuBLAS (``gguf_dequant_mm``); ``gguf_matmul`` takes
the second from ``DEQUANT_MIN_ROWS`` rows. ``--sweep-gemm`` times a grid of fused-GEMM tilings at
16 and 256 rows per shape (best three against ``gemm_config``'s pick).

Times are taken inside a CUDA graph (as decode runs; ``wna16_gpu.cuda_time``), each call on the
next of enough copies of the weights to exceed the L2 cache (decode reads every layer from
memory once per step). ``--sweep`` times a grid of GEMV tilings at batch 1 next to the one
``gemv_config`` picks.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from wna16_gpu import NUM_LAYERS, SHAPES, cuda_time  # this folder's 4/8-bit benchmark

from runtime_quant.gguf_blocks import BY_NAME, dequantize, random_blocks
from runtime_quant.gguf_gpu import (DEQUANT_MIN_ROWS, GEMV_MAX_ROWS, GemmConfig, GemvConfig, gemm_config, gemv_config,
                                    gguf_dequant_mm, gguf_gemm, gguf_gemv, gguf_matmul)

COPIES_BYTES = 256 << 20  # more than any L2 (H100 50 MB, H200 50 MB)


def copies(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor] + [tensor.clone() for _ in range(COPIES_BYTES // tensor.nbytes)]


def time_each(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per ``fn(weight)``, the calls going round ``weights``."""
    per_graph = max(2, 20 // len(weights))
    return cuda_time(lambda: [fn(w) for w in weights], repeats=per_graph, replays=5) / len(weights)


def sweep(layers: dict, t) -> None:
    for name, (raws, _) in layers.items():
        k = raws[0].shape[1] // t.nbytes * t.block
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        chosen = gemv_config(raws[0].shape[0], k, x.device)
        timings = {}
        for block_n, block_k, split, warps in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8, 16), (4, 8)):
            config = GemvConfig(block_n, block_k, split, warps)
            timings[config] = time_each(lambda w: gguf_gemv(w, t, x, None, config=config), raws)
        best = sorted(timings, key=timings.get)[:3]
        chosen_us = time_each(lambda w: gguf_gemv(w, t, x, None, config=chosen), raws)
        nbytes = raws[0].nbytes
        print(f"sweep {t.name} {name:8s}: chosen {chosen} {chosen_us:7.1f} us ({nbytes / chosen_us / 1e3:6.0f} GB/s); best "
              + "; ".join(f"{c} {timings[c]:7.1f} us ({nbytes / timings[c] / 1e3:6.0f} GB/s)" for c in best), flush=True)


def sweep_gemm(layers: dict, t) -> None:
    """Fused-GEMM tilings at 16 and 256 rows (the split is a runtime value: no compile of its own)."""
    block_ks = (128,) if t.name == "Q6_K" else (64, 128)
    grids = {
        16: [GemmConfig(16, bn, bk, split, warps) for bn, bk, warps, split in
             itertools.product((32, 64, 128), block_ks, (4, 8), (1, 4, 8))],
        256: [GemmConfig(bm, bn, bk, 1, 8, stages) for bm, bn, bk, stages in
              itertools.product((64, 128), (32, 64, 128), block_ks, (3,))],
    }
    for rows, grid in grids.items():
        for name, (raws, _) in layers.items():
            k = raws[0].shape[1] // t.nbytes * t.block
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            chosen = gemm_config(t, rows, raws[0].shape[0], k, x.device)
            timings = {}
            for config in grid:
                try:
                    timings[config] = time_each(lambda w: gguf_gemm(w, t, x, None, config=config), raws)
                except Exception as e:  # e.g. out of shared memory or registers at this tile
                    print(f"sweep-gemm {t.name} {rows} {name} {config}: {type(e).__name__} {str(e)[:80]}", flush=True)
            chosen_us = time_each(lambda w: gguf_gemm(w, t, x, None, config=chosen), raws)
            best = sorted(timings, key=timings.get)[:3]
            print(f"sweep-gemm {t.name} rows {rows:3d} {name:8s}: chosen {chosen} {chosen_us:7.1f} us; best "
                  + "; ".join(f"{c} {timings[c]:7.1f} us" for c in best), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0", help="of Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--sweep", action="store_true", help="time a grid of GEMV tilings per shape at batch 1")
    parser.add_argument("--sweep-gemm", action="store_true", help="time a grid of fused-GEMM tilings at 16 and 256 rows")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(torch.cuda.get_device_name(), flush=True)
    table = []
    for type_name in args.types.split(","):
        t = BY_NAME[type_name]
        layers = {}
        for name, (i, o) in SHAPES.items():
            raw = random_blocks(t, o, i, seed=i + o, device="cuda")
            layers[name] = (copies(raw), copies(dequantize(raw, t, torch.bfloat16)))  # [out, in] as F.linear takes it
        if args.sweep:
            sweep(layers, t)
        if args.sweep_gemm:
            sweep_gemm(layers, t)
        for batch in batches:
            totals = dict(packed=0.0, fused=0.0, dequant=0.0, dense=0.0, bytes=0.0)
            for name, (i, o) in SHAPES.items():
                raws, denses = layers[name]
                x = torch.randn(batch, i, device="cuda", dtype=torch.bfloat16)
                expected = torch.nn.functional.linear(x, denses[0]).float()
                err = (gguf_matmul(raws[0], t, x, None).float() - expected).abs().max() / expected.abs().max()
                packed = time_each(lambda w: gguf_matmul(w, t, x, None), raws)
                cublas = time_each(lambda w: torch.nn.functional.linear(x, w), denses)
                line = ""
                if batch > GEMV_MAX_ROWS:  # both large-batch paths
                    fused = time_each(lambda w: gguf_gemm(w, t, x, None), raws)
                    dequant = time_each(lambda w: gguf_dequant_mm(w, t, x, None), raws)
                    totals["fused"] += fused
                    totals["dequant"] += dequant
                    line = f", fused {fused:8.1f} us, dequant+mm {dequant:8.1f} us"
                totals["packed"] += packed
                totals["dense"] += cublas
                totals["bytes"] += raws[0].nbytes
                print(f"{t.name} batch {batch:4d} {name:8s} [{i}x{o}]: packed {packed:8.1f} us "
                      f"({raws[0].nbytes / packed / 1e3:7.1f} GB/s), bf16 {cublas:8.1f} us "
                      f"({denses[0].nbytes / cublas / 1e3:7.1f} GB/s){line}, max |diff| / max {err:.2g}", flush=True)
            ms = {key: value * NUM_LAYERS / 1e3 for key, value in totals.items() if key != "bytes"}
            row = (t.name, batch, ms["packed"], ms["fused"], ms["dequant"], ms["dense"], totals["bytes"] / totals["packed"] / 1e3)
            table.append(row)
            print(f"{t.name} batch {batch:4d} all linears x {NUM_LAYERS} layers: packed {ms['packed']:.2f} ms, "
                  f"bf16 {ms['dense']:.2f} ms\n", flush=True)
        del layers
        torch.cuda.empty_cache()
    print(f"{'type':5s} {'batch':>5s} {'packed ms':>10s} {'fused ms':>9s} {'deq+mm ms':>9s} {'bf16 ms':>8s} "
          f"{'packed/bf16':>11s} {'fused/bf16':>10s} {'deq+mm/bf16':>11s} {'packed GB/s':>11s}  "
          f"(all linears x {NUM_LAYERS} layers; packed = gguf_matmul: GEMV <= {GEMV_MAX_ROWS} rows, "
          f"dequant+mm >= {DEQUANT_MIN_ROWS}, else fused)")
    for name, batch, packed, fused, dequant, dense, gbs in table:
        extra = f"{fused:9.2f} {dequant:9.2f}" if fused else f"{'-':>9s} {'-':>9s}"
        ratios = f"{fused / dense:10.2f} {dequant / dense:11.2f}" if fused else f"{'-':>10s} {'-':>11s}"
        print(f"{name:5s} {batch:5d} {packed:10.2f} {extra} {dense:8.2f} {packed / dense:11.2f} {ratios} {gbs:11.0f}")


if __name__ == "__main__":
    main()
