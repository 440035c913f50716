"""CPU: weight-only 4/8-bit linear layers kept packed vs the dequantized bf16 / fp32 linear.

Shapes of the default model (SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV
heads of 64): qkv, o, gate_up, down. Prints microseconds per call of all four layers
(one decoder layer's linears) for each batch size, and the bytes of their weights.

    python plugins/quant/bench/wna16_cpu.py [--bits 4] [--group 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from runtime_quant.packing import pack
from runtime_quant.wna16_kernels import KERNELS, BoundKernel
from runtime_quant.wna16_scheme import WNA16Scheme

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}


def packed_layer(in_features: int, out_features: int, scheme: WNA16Scheme, dtype: torch.dtype, kernel: str):
    """A random layer in the canonical layout, repacked for ``kernel``."""
    layer = nn.Module()
    layer.in_features = in_features
    layer.quant_params_dtype = dtype
    layer.quant_group_rows = scheme.rows_per_group(in_features)
    layer.quant_bits = scheme.bits
    groups = scheme.groups(in_features)
    codes = torch.randint(0, 1 << scheme.bits, (in_features, out_features), dtype=torch.uint8)
    layer.qweight = nn.Parameter(pack(codes, scheme.bits, dim=0), requires_grad=False)
    layer.scales = nn.Parameter(torch.rand(groups, out_features) * 0.01, requires_grad=False)
    layer.zeros = nn.Parameter(torch.randint(0, 1 << scheme.bits, (groups, out_features), dtype=torch.uint8),
                               requires_grad=False)
    bound = BoundKernel(next(k for k in KERNELS if k.name == kernel), scheme)
    bound.prepare(layer)
    return layer, bound


def timed(fn, repeats: int, rounds: int = 5) -> float:
    """The best of ``rounds`` averages over ``repeats`` calls (robust to a busy machine)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats * 1e6)
    return best


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scheme = WNA16Scheme("gptq", args.bits, args.group, symmetric=False)
    fast = "int4pack_mm" if args.bits == 4 else ("int8pack_mm" if args.group == -1 else "sliced_matmul")
    kernels = [fast, "sliced_matmul"] if fast != "sliced_matmul" else [fast]
    print(f"{args.bits}-bit, group {args.group}, {args.threads} threads; us per call of the 4 linears of one layer")
    for dtype in (torch.bfloat16, torch.float32):
        dense = {n: nn.Linear(i, o, bias=False).to(dtype) for n, (i, o) in SHAPES.items()}
        layers = {k: {n: packed_layer(i, o, scheme, dtype, k) for n, (i, o) in SHAPES.items()} for k in kernels}
        weight_bytes = {k: sum(nbytes(layer) for layer, _ in v.values()) for k, v in layers.items()}
        print(f"\n{str(dtype)[6:]}: weights dense {sum(nbytes(m) for m in dense.values()) / 1e6:.2f} MB, "
              + ", ".join(f"{k} {b / 1e6:.2f} MB" for k, b in weight_bytes.items()))
        for batch in map(int, args.batches.split(",")):
            xs = {n: torch.randn(batch, i).to(dtype) for n, (i, _) in SHAPES.items()}
            repeats = max(2, 64 // batch)
            with torch.inference_mode():
                row = {"dense": timed(lambda: [dense[n](xs[n]) for n in SHAPES], repeats)}
                for k in kernels:
                    row[k] = timed(lambda: [b.run(layer, xs[n], None) for n, (layer, b) in layers[k].items()], repeats)
            print(f"  batch {batch:4d}: " + ", ".join(f"{k} {us:9.1f}" for k, us in row.items()))


if __name__ == "__main__":
    main()
