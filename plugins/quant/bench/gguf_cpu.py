"""CPU: the default GGUF model loaded with ``--quantization gguf`` (blocks kept) vs dequantized at load.

Prints, for each way of loading (``--dtype``, default bfloat16): the bytes of the loaded model's
parameters (all, and the linear layers alone), the process's resident memory after loading
(each way in a fresh process), and the milliseconds of one decoder layer's linears (the
model's own layers 0) at a few batch sizes, taken in turns packed / dense.

    python plugins/quant/bench/gguf_cpu.py [--model PATH] [--dtype bfloat16] [--threads 2] [--batches 1,16,64,512]

``--kernels`` instead times the 4-bit kernels alone on the default model's four linear shapes
(random Q4_1 blocks, bf16): the panel kernel (``gguf_cpu_panels``) in its two ways (scales folded
into the sums; a panel dequantized, then ``vdpbf16ps``) and as dispatched, torch's int4 tiles
(``_weight_int4pack_mm_for_cpu``, the previous packed path) and the dense bf16 matmul.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def load(model: str | None, dtype: str, packed: bool):
    from runtime.config import parse_dtype
    from runtime.model_loader import load_model, resolve_model
    from runtime.model_loader.default_model import default_model_path
    from runtime_quant.gguf import GgufConfig

    resolved = resolve_model(model or default_model_path())
    return load_model(resolved, dtype=parse_dtype(dtype, None), quant_config=GgufConfig() if packed else None)


def linears(model) -> dict:
    return {name: m for name, m in model.named_modules() if hasattr(m, "output_sizes")}


def memory(args, packed: bool) -> dict:
    """Run in a fresh process: parameter bytes and peak resident memory after loading."""
    model = load(args.model, args.dtype, packed)
    params = sum(p.nbytes for p in model.parameters())
    linear = sum(p.nbytes for m in linears(model).values() for p in m.parameters(recurse=False) if p.dim() >= 2)
    return {"params_mb": params / 2**20, "linear_mb": linear / 2**20,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def timings(args) -> None:
    torch.set_num_threads(args.threads)
    models = {"packed": load(args.model, args.dtype, True), "dense": load(args.model, args.dtype, False)}
    layers = {way: [m for n, m in linears(model).items() if ".layers.0." in n] for way, model in models.items()}
    dtype = next(models["dense"].parameters()).dtype
    for batch in (int(b) for b in args.batches.split(",")):
        totals = {way: [] for way in models}
        for _ in range(args.repeats):
            for way, mods in layers.items():  # in turns: a busy neighbour hits both
                xs = [torch.randn(batch, m.in_features, dtype=dtype) for m in mods]
                for m, x in zip(mods, xs):
                    m(x)
                start = time.perf_counter()
                for m, x in zip(mods, xs):
                    m(x)
                totals[way].append((time.perf_counter() - start) * 1e3)
        print(f"batch {batch:4d}: layer 0's linears, median of {args.repeats}: " +
              ", ".join(f"{way} {sorted(v)[len(v) // 2]:.3f} ms" for way, v in totals.items()), flush=True)


SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down


def kernels(args) -> None:
    from runtime_quant import gguf_cpu_panels as panels
    from runtime_quant.gguf_blocks import BY_NAME, decode, dequantize, random_blocks

    torch.set_num_threads(args.threads)
    assert panels.available(), "the panel kernel needs AVX-512 BF16 and a C++ compiler"
    t = BY_NAME["Q4_1"]
    layers = []
    for n, k in SMOLLM2_SHAPES:
        raw = random_blocks(t, n, k)
        codes, scale, offset = decode(raw, t)
        tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        sz = torch.stack([scale.t(), (offset + 8 * scale).t()], dim=-1).bfloat16().contiguous()
        layers.append((panels.pack(codes, scale, offset), tiles, sz, dequantize(raw, t, torch.bfloat16)))
    ways = {
        "panels": lambda x, L: panels.panels_mm(x, *L[0]),
        "folded": lambda x, L: panels.panels_mm(x, *L[0], folded_max_rows=1 << 30),
        "dequantized panel": lambda x, L: panels.panels_mm(x, *L[0], folded_max_rows=0),
        "torch int4": lambda x, L: torch.ops.aten._weight_int4pack_mm_for_cpu(x, L[1], 32, L[2]),
        "bf16": lambda x, L: torch.matmul(x, L[3].t()),
    }
    for batch in (int(b) for b in args.batches.split(",")):
        xs = [torch.randn(batch, k).bfloat16() for _, k in SMOLLM2_SHAPES]
        totals = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, fn in ways.items():  # in turns
                for x, L in zip(xs, layers):
                    fn(x, L)
                start = time.perf_counter()
                for x, L in zip(xs, layers):
                    fn(x, L)
                totals[way].append((time.perf_counter() - start) * 1e3)
        print(f"batch {batch:4d}: four linears, median of {args.repeats}: " +
              ", ".join(f"{way} {sorted(v)[len(v) // 2]:.3f} ms" for way, v in totals.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,16,64,512")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--kernels", action="store_true", help="time the 4-bit kernels alone (see above)")
    parser.add_argument("--memory-of", choices=("packed", "dense"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(memory(args, args.memory_of == "packed")))
        return
    if args.kernels:
        kernels(args)
        return
    for way in ("dense", "packed"):
        cmd = [sys.executable, __file__, "--dtype", args.dtype, "--memory-of", way] + (["--model", args.model] if args.model else [])
        result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"{way:6s}: parameters {result['params_mb']:.1f} MiB (linear layers {result['linear_mb']:.1f} MiB), "
              f"peak RSS after load {result['max_rss_mb']:.0f} MiB", flush=True)
    timings(args)


if __name__ == "__main__":
    main()
