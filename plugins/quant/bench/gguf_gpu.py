"""GPU: the Triton GGUF kernels (blocks dequantized in the kernel) on Llama-3.1-8B's linear layers vs bf16 cuBLAS.

Random blocks of each ggml type (:func:`runtime_quant.gguf_blocks.random_blocks`) for every
layer shape; for each batch size prints microseconds per call of the packed kernel
(``gguf_matmul``: the GEMV up to 4 rows, else the dequantize-tile GEMM) and of
``torch.nn.functional.linear`` on the dequantized bf16 weight, the packed kernel's effective
bandwidth (bytes of blocks read once, per second), the largest difference from the bf16 result,
and the sum over one decoder layer times 32 layers.

    python plugins/quant/bench/gguf_gpu.py [--types Q4_K,Q6_K,...] [--batches 1,4,16,64,256] [--sweep]

Times are taken inside a CUDA graph (as decode runs; ``wna16_gpu.cuda_time``). ``--sweep``
times a grid of GEMV tilings for one-row batches next to the one ``gemv_config`` picks.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from wna16_gpu import NUM_LAYERS, SHAPES, cuda_time  # this folder's 4/8-bit benchmark

from runtime_quant.gguf_blocks import BLOCK_TYPES, BY_NAME, dequantize, random_blocks
from runtime_quant.gguf_gpu import GemvConfig, gemv_config, gguf_gemv, gguf_matmul


def sweep(layers: dict, t) -> None:
    for name, (raw, _) in layers.items():
        k = raw.shape[1] // t.nbytes * t.block
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        chosen = gemv_config(raw.shape[0], k, x.device)
        timings = {}
        for block_n, block_k, split, warps in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8, 16), (2, 4, 8)):
            config = GemvConfig(block_n, block_k, split, warps)
            timings[config] = cuda_time(lambda: gguf_gemv(raw, t, x, None, config=config), repeats=10, replays=5)
        best = sorted(timings, key=timings.get)[:3]
        chosen_us = cuda_time(lambda: gguf_gemv(raw, t, x, None, config=chosen))
        print(f"sweep {t.name} {name:8s}: chosen {chosen} {chosen_us:7.1f} us ({raw.nbytes / chosen_us / 1e3:6.0f} GB/s); best "
              + "; ".join(f"{c} {timings[c]:7.1f} us ({raw.nbytes / timings[c] / 1e3:6.0f} GB/s)" for c in best), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default=",".join(t.name for t in BLOCK_TYPES.values()))
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time a grid of GEMV tilings per shape at batch 1")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for type_name in args.types.split(","):
        t = BY_NAME[type_name]
        layers = {}
        for name, (i, o) in SHAPES.items():
            raw = random_blocks(t, o, i, seed=i + o, device="cuda")
            layers[name] = (raw, dequantize(raw, t, torch.bfloat16))  # [out, in] as F.linear takes it
        if args.sweep:
            sweep(layers, t)
        for batch in batches:
            total_packed = total_dense = 0.0
            for name, (i, o) in SHAPES.items():
                raw, dense = layers[name]
                x = torch.randn(batch, i, device="cuda", dtype=torch.bfloat16)
                err = (gguf_matmul(raw, t, x, None).float() - torch.nn.functional.linear(x, dense).float()).abs().max()
                packed = cuda_time(lambda: gguf_matmul(raw, t, x, None))
                cublas = cuda_time(lambda: torch.nn.functional.linear(x, dense))
                total_packed += packed
                total_dense += cublas
                print(f"{t.name} batch {batch:4d} {name:8s} [{i}x{o}]: packed {packed:8.1f} us "
                      f"({raw.nbytes / packed / 1e3:7.1f} GB/s), bf16 {cublas:8.1f} us, max |diff| {err:.3g}")
            print(f"{t.name} batch {batch:4d} all linears x {NUM_LAYERS} layers: packed {total_packed * NUM_LAYERS / 1e3:.2f} ms, "
                  f"bf16 {total_dense * NUM_LAYERS / 1e3:.2f} ms\n", flush=True)


if __name__ == "__main__":
    main()
