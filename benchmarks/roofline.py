"""Roofline of the W1-W3 workloads on this GPU, from measured copy bandwidth and bf16 matmul rate.

Measures device-to-device copy bandwidth (bytes read + written per second) and the bf16
matmul rate (8192^3), then models each workload as an ideal engine would run it: prefill
of every prompt at the matmul rate, then decode steps whose time is the larger of
(weights + every running request's KV) / bandwidth and 2 * params * batch / matmul rate.
Prints the ideal output tokens/s per workload.

    python3 benchmarks/roofline.py [--max-num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from cuda_timing import cuda_ms

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _seconds(lambda: dst.copy_(src))


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / _seconds(lambda: a @ b)


def _seconds(fn, iters: int = 20) -> float:
    return cuda_ms(fn, iters) / 1000


def shape(name: str) -> tuple[float, float]:
    """(parameter count, KV bytes per token in bf16) of a config in benchmarks/configs."""
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    layers, hidden, inter, vocab = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    attn = hidden * head * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    params = layers * (attn + 3 * hidden * inter) + vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return params, 2 * layers * c["num_key_value_heads"] * head * 2


def ideal_time(model: str, prompts: list[int], outputs: list[int], max_seqs: int, bw: float, flops: float) -> float:
    """Seconds for an ideal engine: waves of ``max_seqs`` requests, prefill then decode."""
    params, kv_per_token = shape(model)
    total = 0.0
    for lo in range(0, len(prompts), max_seqs):
        wave_p, wave_o = prompts[lo : lo + max_seqs], outputs[lo : lo + max_seqs]
        total += 2 * params * sum(wave_p) / flops
        for step in range(max(wave_o)):
            running = [p + step for p, o in zip(wave_p, wave_o) if step < o]
            bytes_ = 2 * params + kv_per_token * sum(running)
            total += max(bytes_ / bw, 2 * params * len(running) / flops)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    bw, flops = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    mean_w1_prompt = (100 + 1024) // 2
    workloads = {
        "W1": ("qwen3-0.6b", [mean_w1_prompt] * 256, [512] * 256),
        "W2": ("llama-3.1-8b", [1000] * 1000, [1000] * 1000),
        "W3": ("llama-3.1-8b", [128], [512]),
    }
    for name, (model, prompts, outputs) in workloads.items():
        seconds = ideal_time(model, prompts, outputs, args.max_num_seqs, bw, flops)
        line = f"{name}: ideal {sum(outputs) / seconds:,.0f} output tok/s"
        if len(prompts) == 1:
            params, _ = shape(model)
            line += f"; weights alone {2 * params / bw * 1000:.2f} ms per token"
        print(line)


if __name__ == "__main__":
    main()
