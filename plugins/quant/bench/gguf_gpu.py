"""GPU: the Triton GGUF kernels (blocks dequantized in the kernel) on Llama-3.1-8B's linear layers vs bf16 cuBLAS.

Random blocks of each ggml type (:func:`runtime_quant.gguf_blocks.random_blocks`) for every
layer shape; for each batch size prints microseconds per call of the packed kernel
(``gguf_matmul``: the GEMV up to 4 rows, else the dequantize-tile GEMM) and of
``torch.nn.functional.linear`` on the dequantized bf16 weight, the packed kernel's bandwidth
(bytes of blocks read once, per second), its largest difference from the bf16 result (relative
to the largest value), the sum over one decoder layer times 32 layers, and a table of those sums last.

    python plugins/quant/bench/gguf_gpu.py [--types Q4_0,Q4_K,...] [--batches 1,16,256] [--sweep]

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
from runtime_quant.gguf_gpu import GemvConfig, gemv_config, gguf_gemv, gguf_matmul

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0", help="of Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--sweep", action="store_true", help="time a grid of GEMV tilings per shape at batch 1")
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
        for batch in batches:
            total_packed = total_dense = total_bytes = 0.0
            for name, (i, o) in SHAPES.items():
                raws, denses = layers[name]
                x = torch.randn(batch, i, device="cuda", dtype=torch.bfloat16)
                expected = torch.nn.functional.linear(x, denses[0]).float()
                err = (gguf_matmul(raws[0], t, x, None).float() - expected).abs().max() / expected.abs().max()
                packed = time_each(lambda w: gguf_matmul(w, t, x, None), raws)
                cublas = time_each(lambda w: torch.nn.functional.linear(x, w), denses)
                total_packed += packed
                total_dense += cublas
                total_bytes += raws[0].nbytes
                print(f"{t.name} batch {batch:4d} {name:8s} [{i}x{o}]: packed {packed:8.1f} us "
                      f"({raws[0].nbytes / packed / 1e3:7.1f} GB/s), bf16 {cublas:8.1f} us "
                      f"({denses[0].nbytes / cublas / 1e3:7.1f} GB/s), max |diff| / max {err:.2g}", flush=True)
            row = (t.name, batch, total_packed * NUM_LAYERS / 1e3, total_dense * NUM_LAYERS / 1e3, total_bytes / total_packed / 1e3)
            table.append(row)
            print(f"{t.name} batch {batch:4d} all linears x {NUM_LAYERS} layers: packed {row[2]:.2f} ms, bf16 {row[3]:.2f} ms\n",
                  flush=True)
        del layers
        torch.cuda.empty_cache()
    print(f"{'type':5s} {'batch':>5s} {'packed ms':>10s} {'bf16 ms':>8s} {'packed/bf16':>11s} {'packed GB/s':>11s}  "
          f"(all linears x {NUM_LAYERS} layers)")
    for name, batch, packed, dense, gbs in table:
        print(f"{name:5s} {batch:5d} {packed:10.2f} {dense:8.2f} {packed / dense:11.2f} {gbs:11.0f}")


if __name__ == "__main__":
    main()
