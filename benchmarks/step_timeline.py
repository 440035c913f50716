"""Where an offline throughput run's time goes, step by step, on a GPU.

Runs the same workload as ``runtime bench throughput`` (random prompt ids, dummy weights,
greedy, ``ignore_eos``) through ``LLM.generate`` and records, for every engine step, how
many decode tokens and prefill tokens it computed and when its sampled tokens reached the
scheduler. Steps are grouped by kind (decode only, or with prefill tokens) and by batch
size, so the summary says how much wall time each kind took and at what rate; with
``--profile-step N`` the GPU kernels of steps N..N+``--profile-count`` are summed by
category (attention, matmul, gemv, norm/rotary/activation, sampling, other).

    python3 benchmarks/step_timeline.py --model benchmarks/configs/llama-3.1-8b \\
        --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 256 \\
        --max-model-len 2048 --async-scheduling --profile-step 600

Writes ``$OUT/step_timeline.json`` (one row per step) when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class StepRecord:
    decode_tokens: int  # requests computing exactly one token
    prefill_tokens: int  # tokens of requests computing more than one
    done_at: float  # when the step's sampled tokens reached the scheduler (perf_counter)


KERNEL_CATEGORIES = (  # first match wins; names are lower-cased kernel names
    ("attention", ("unified_attention", "attention", "flash", "sdpa")),
    ("kv write", ("reshape_and_cache",)),
    ("gemv", ("gemv",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "ampere")),
    ("norm/rotary/act", ("rms", "rotary", "silu", "norm")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "max")),
)


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(key in name for key in keys):
            return category
    return "other"


def record_steps(
    llm, profile_at: int, profile_count: int
) -> tuple[list[StepRecord], dict[str, float], dict[str, float]]:
    """Wrap the scheduler's update so every finished step appends a record; with ``profile_at`` >= 0 the
    profiled steps' kernel microseconds fill the two dicts, by category and by kernel name."""
    import torch

    scheduler = llm.llm_engine.engine_core.scheduler
    update = scheduler.update_from_output
    records: list[StepRecord] = []
    kernel_us: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    profiler = None

    def timed_update(scheduler_output, runner_output):
        nonlocal profiler
        counts = scheduler_output.num_scheduled_tokens.values()
        records.append(StepRecord(sum(1 for n in counts if n == 1), sum(n for n in counts if n > 1), time.perf_counter()))
        if profile_at >= 0 and len(records) == profile_at:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        elif profiler is not None and len(records) == profile_at + profile_count:
            torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            for event in profiler.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernel_us[categorize(event.name)] += event.device_time_total
                    by_name[event.name] += event.device_time_total
            profiler = None
        return update(scheduler_output, runner_output)

    scheduler.update_from_output = timed_update
    return records, kernel_us, by_name


def log_compiles(clock: list[float]) -> None:
    """Print every Triton kernel the process compiles from now on, with its specialization (the constants and the
    arguments' divisibility) and the time since ``clock[0]`` (a start-up compile before the timed run sets it)."""
    import triton

    def hook(*, repr: str, compile: dict, **_) -> bool:
        print(f"compile at {time.perf_counter() - clock[0]:8.3f} s: {repr.split('(')[0]} "
              f"constants={compile.get('constants')} attrs={compile.get('configs')}", flush=True)
        return False  # go on and compile

    triton.knobs.runtime.jit_cache_hook = hook


def summarize(records: list[StepRecord], start: float) -> list[dict]:
    """Wall time per (kind, batch-size bucket); a step's time is the gap since the one before."""
    groups: dict[tuple[str, int], dict] = {}
    previous = start
    for record in records:
        kind = "decode" if record.prefill_tokens == 0 else "mixed"
        bucket = 64 * ((record.decode_tokens + 63) // 64)
        group = groups.setdefault((kind, bucket), {"kind": kind, "decodes<=": bucket, "steps": 0, "seconds": 0.0,
                                                   "decode_tokens": 0, "prefill_tokens": 0})
        group["steps"] += 1
        group["seconds"] += record.done_at - previous
        group["decode_tokens"] += record.decode_tokens
        group["prefill_tokens"] += record.prefill_tokens
        previous = record.done_at
    return sorted(groups.values(), key=lambda g: (g["kind"], g["decodes<="]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--quantization", default=None, help="as the engine's --quantization (e.g. fp8)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (the profiler lists the kernels of graph replays only partly)")
    parser.add_argument("--profile-step", type=int, default=-1, help="first step to profile (-1: none)")
    parser.add_argument("--profile-count", type=int, default=10)
    parser.add_argument("--top", type=int, default=15, help="kernels listed by name with --profile-step")
    parser.add_argument("--first-steps", type=int, default=0, help="print the time of each of the first N steps")
    parser.add_argument("--log-compiles", action="store_true",
                        help="print each Triton kernel compiled (a new specialization), at start-up and in the timed run")
    args = parser.parse_args()

    from runtime import LLM, SamplingParams
    from runtime.bench.throughput import make_workload

    clock = [time.perf_counter()]  # compiles print their time since start-up, then since the timed run's start
    if args.log_compiles:
        log_compiles(clock)

    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, platform=args.platform,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    vocab = int(llm.llm_engine.config.model_config.hf_config.vocab_size)
    workload = make_workload(args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2, vocab, seed=0)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm up
    records, kernel_us, by_name = record_steps(llm, args.profile_step, args.profile_count)
    start = clock[0] = time.perf_counter()
    if args.log_compiles:
        print("the timed run starts", flush=True)
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    groups = summarize(records, start)
    scheduler = llm.llm_engine.engine_core.scheduler
    print(f"{len(records)} steps, {elapsed:.2f} s, {args.num_prompts * args.output_len / elapsed:,.1f} output tok/s, "
          f"{scheduler.num_preemptions} preemptions, {scheduler.kv_cache_manager.num_blocks} KV blocks")
    print(f"{'kind':7} {'decodes<=':>9} {'steps':>6} {'seconds':>8} {'ms/step':>8} {'decode tok':>11} {'prefill tok':>12}")
    for g in groups:
        print(f"{g['kind']:7} {g['decodes<=']:9d} {g['steps']:6d} {g['seconds']:8.2f} {1000 * g['seconds'] / g['steps']:8.2f} "
              f"{g['decode_tokens']:11d} {g['prefill_tokens']:12d}")
    previous = start
    for i, record in enumerate(records[: args.first_steps]):
        print(f"step {i}: {1000 * (record.done_at - previous):8.1f} ms, {record.decode_tokens} decodes, "
              f"{record.prefill_tokens} prefill tokens")
        previous = record.done_at
    if kernel_us:
        total = sum(kernel_us.values())
        print(f"GPU kernels over steps {args.profile_step}..{args.profile_step + args.profile_count - 1}: "
              f"{total / 1000 / args.profile_count:.2f} ms/step")
        for category, us in sorted(kernel_us.items(), key=lambda kv: -kv[1]):
            print(f"  {category:16} {us / 1000 / args.profile_count:8.2f} ms/step ({100 * us / total:4.1f} %)")
        print(f"the {args.top} longest kernels:")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us / 1000 / args.profile_count:8.2f} ms/step  {name[:110]}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "step_timeline.json"), "w") as f:
            json.dump({"elapsed_s": elapsed, "groups": groups, "kernel_ms_per_step": {k: v / 1000 / args.profile_count for k, v in kernel_us.items()},
                       "steps": [[r.decode_tokens, r.prefill_tokens, r.done_at - start] for r in records]}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
