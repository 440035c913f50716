"""Where a decode step's time goes on a GPU: host phases, GPU kernel time, top kernels.

Fills the engine with ``--num-requests`` requests of ``--context`` random prompt tokens
(dummy weights), waits until every request decodes, then

1. times ``--steps`` engine steps, split into scheduling, the worker (input preparation,
   model, sampling, waiting for the sampled tokens), the scheduler's update and the
   output processor (host wall time of each phase);
2. records a few more steps under ``torch.profiler`` and sums the GPU kernel time per
   step, with the kernels that take most of it.

    python3 benchmarks/profile_decode.py --model benchmarks/configs/qwen3-0.6b --num-requests 256 --context 800

Compare ``--enforce-eager`` against the default (CUDA graphs), and ``--async-scheduling``
(host phases then overlap the device; "launch" is the host time to queue a step). Writes
``$OUT/profile_decode_<label>.json`` when ``OUT`` is set, and with ``--trace N`` a Chrome trace of N
more steps (host calls with Python stacks, and the device's kernels and copies) to
``$OUT/trace_<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict


MAX_TOKENS = 4096


class PhaseTimer:
    """Wall time of wrapped callables, per phase, for the current step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start

        return timed


def build_engine(args):
    from runtime.engine_args import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(
        model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, platform="cuda",
        max_num_seqs=args.num_requests, max_model_len=args.context + MAX_TOKENS + 1,
        enforce_eager=args.enforce_eager, enable_prefix_caching=False, async_scheduling=args.async_scheduling,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )
    return LLMEngine.from_engine_args(engine_args)


def fill(engine, args) -> None:
    from runtime import RequestOutputKind, SamplingParams

    rng = random.Random(0)
    # Long enough that no request finishes while steps are measured (prefill takes many steps).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(args.num_requests):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(10, 30000) for _ in range(args.context)]}, params)
    scheduler = engine.engine_core.scheduler
    while True:  # prefill every prompt, then a few decode steps
        engine.step()
        if scheduler.stats()["num_running"] == args.num_requests and not any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
        ):
            break
    for _ in range(3):
        engine.step()


def time_phases(engine, steps: int) -> dict[str, float]:
    core = engine.engine_core
    timer = PhaseTimer()
    core.scheduler.schedule = timer.wrap("schedule", core.scheduler.schedule)
    core.executor.execute_model = timer.wrap("worker", core.executor.execute_model)
    core.executor.execute_model_async = timer.wrap("launch", core.executor.execute_model_async)
    core.scheduler.update_from_output = timer.wrap("update", core.scheduler.update_from_output)
    engine.output_processor.process_outputs = timer.wrap("outputs", engine.output_processor.process_outputs)
    per_step = defaultdict(list)
    for _ in range(steps):
        timer.current.clear()
        start = time.perf_counter()
        engine.step()
        per_step["step"].append(time.perf_counter() - start)
        for name, value in timer.current.items():
            per_step[name].append(value)
    return {name: 1000 * statistics.median(values) for name, values in per_step.items()}


def gpu_kernel_time(engine, steps: int, top: int = 8) -> tuple[float, float, list[tuple[str, float]]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    launches = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches += 1
            kernels[event.name[:90]] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    total_ms = sum(kernels.values()) / 1000 / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return total_ms, launches / steps, [(name, us / 1000 / steps) for name, us in ranked]


def write_trace(engine, steps: int, path: str) -> None:
    """A Chrome trace of ``steps`` engine steps: host calls (with Python stacks) and device work."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (vLLM's flag)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument("--trace", type=int, default=0, help="steps to record into $OUT/trace_<label>.json (host and device, with Python stacks)")
    parser.add_argument("--top", type=int, default=8, help="kernels to list")
    args = parser.parse_args()
    label = f"{os.path.basename(os.path.normpath(args.model))}-{args.num_requests}x{args.context}-{'eager' if args.enforce_eager else 'graphs'}{'-async' if args.async_scheduling else ''}"
    label += f"{'-' + args.quantization if args.quantization else ''}{'-kv' + args.kv_cache_dtype if args.kv_cache_dtype != 'auto' else ''}"
    engine = build_engine(args)
    fill(engine, args)
    phases = time_phases(engine, args.steps)
    gpu_ms, launches, kernels = gpu_kernel_time(engine, args.profile_steps, args.top)
    if args.trace and os.environ.get("OUT"):
        write_trace(engine, args.trace, os.path.join(os.environ["OUT"], f"trace_{label}.json"))
    running = engine.engine_core.scheduler.stats()["num_running"]
    assert running == args.num_requests, f"only {running} of {args.num_requests} requests ran to the end"
    result = {"label": label, "host_ms": phases, "gpu_kernel_ms_per_step": gpu_ms, "kernels_per_step": launches,
              "top_kernels_ms": kernels}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_decode_{label}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"{label}: step {phases['step']:.2f} ms = " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "step")
          + f"; GPU kernels {gpu_ms:.2f} ms/step in {launches:.0f} kernels")
    for name, ms in kernels:
        print(f"  {ms:7.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
