"""Where a batch-1 decode step's time goes on the CPU (issue 17).

Builds an engine on the default model (or ``--model``), prefills one request of
``--input-len`` random tokens, then

1. times ``--steps`` decode steps, split into the scheduler, the model runner's
   input preparation, the model's forward, logits + sampling, the scheduler's update and
   the output processor (host wall time of each phase, medians);
2. records ``--profile-steps`` more steps under ``torch.profiler`` and prints the ops
   that take most of the time (self CPU time per step).

    python benchmarks/cpu_decode_profile.py --dtype bfloat16
    python benchmarks/cpu_decode_profile.py --dtype float32 --enforce-eager

``--alternate N`` times compiled and eager steps in turns in one engine (RUNTIME_CPU_COMPILE=1);
``--split`` times the forward's parts. Both give wall and main-thread CPU time: with
``--threads 1`` the CPU time hardly depends on other jobs sharing the machine, while two
threads' kernels slow down many times whenever another job takes a core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict


class CallTimer:
    """Wall time of each call of wrapped methods (each runs once per decode step)."""

    def __init__(self):
        self.calls: dict[str, list[float]] = defaultdict(list)

    def wrap(self, name: str, obj, attr: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[name].append(time.perf_counter() - start)

        setattr(obj, attr, timed)


def build(args):
    from runtime import RequestOutputKind, SamplingParams
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_args import EngineArgs

    kwargs = dict(dtype=args.dtype, enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                  cpu_num_threads=args.threads)
    from runtime.model_loader.default_model import default_model_path

    kwargs["model"] = args.model or default_model_path()
    if args.quantization:
        kwargs["quantization"] = args.quantization
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + args.profile_steps + 20 * args.alternate + 30, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("0", {"prompt_token_ids": [rng.randrange(10, 30000) for _ in range(args.input_len)]}, params)
    for _ in range(4):  # the prefill, then a few decodes
        engine.step()
    return engine


def time_phases(engine, steps: int) -> dict[str, float]:
    """Median ms per step of the engine's phases (profile_decode's) and of the model runner's."""
    from profile_decode import time_phases as engine_phases  # benchmarks/ is the script's folder

    runner = engine.engine_core.executor.worker.model_runner
    timer = CallTimer()
    timer.wrap("prepare", runner.input_batch, "prepare")
    if runner.graphs is not None and runner.graphs.compiled is not None:
        timer.wrap("model", runner.graphs, "run")  # the compiled forward, its metadata built
    else:
        timer.wrap("model", runner.model, "forward")
    timer.wrap("logits", runner.model, "compute_logits")
    timer.wrap("sample", runner, "sampler")
    phases = engine_phases(engine, steps)
    return phases | {name: 1000 * statistics.median(values) for name, values in timer.calls.items()}


def clocks(fn, repeats: int) -> tuple[float, float]:
    """Median wall and main-thread CPU ms of ``fn()``. With ``--threads 1`` the CPU time is the
    work itself: other jobs on the machine stretch the wall time, hardly the CPU time."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return 1000 * statistics.median(wall), 1000 * statistics.median(cpu)


def alternate(engine, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """Step times with the compiled decode path and without it (the same engine, eager steps
    through the same runner), alternating blocks of ``steps`` so both see the same load."""
    runner = engine.engine_core.executor.worker.model_runner
    graphs, times = runner.graphs, {"compiled": [], "eager": []}
    for _ in range(rounds):
        for label in ("compiled", "eager"):
            runner.graphs = graphs if label == "compiled" else None
            times[label] += [clocks(engine.step, 1) for _ in range(steps)]
    runner.graphs = graphs
    return {label: tuple(statistics.median(t[i] for t in values) for i in (0, 1)) for label, values in times.items()}


def split(engine, repeats: int) -> dict[str, tuple[float, float]]:
    """One decode step's forward in parts: compiled, compiled with attention stubbed out (the
    backend returns an empty tensor), eager, the linear layers alone (eager, one row), logits."""
    import torch

    from runtime.models.layers import Linear
    from runtime.worker.graphs import GraphShape

    runner = engine.engine_core.executor.worker.model_runner
    graphs, model = runner.graphs, runner.model
    parts = {"eager forward": lambda: graphs._run_compiled(1, model)}
    if graphs.compiled is not None:
        backend, real = graphs.backend, graphs.backend.forward
        parts["compiled forward"] = lambda: graphs.run(GraphShape(1, 1))

        def stubbed():
            backend.forward = lambda spec, q, k, v, cache, metadata: torch.empty_like(q)
            try:
                graphs.run(GraphShape(1, 1))
            finally:
                backend.forward = real

        parts["compiled, attention stubbed"] = stubbed
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=dtype) for m in linears}
    parts[f"{len(linears)} linear layers"] = lambda: [m(rows[m.in_features]) for m in linears]
    hidden = torch.randn(1, model.config.hidden_size, dtype=dtype)
    parts["logits"] = lambda: model.compute_logits(hidden)
    with torch.inference_mode():
        for fn in parts.values():
            fn()
        return {name: clocks(fn, repeats) for name, fn in parts.items()}


def op_table(engine, steps: int, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1000 / steps
    count = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    print(f"profiled self CPU time {total:.2f} ms/step, {count:.0f} aten op calls/step (torch {torch.__version__})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="--cpu-num-threads")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--alternate", type=int, default=0, help="rounds of compiled vs eager blocks (A/B in one engine)")
    parser.add_argument("--split", action="store_true", help="time the forward's parts (needs the decode graphs object)")
    args = parser.parse_args()
    engine = build(args)
    label = f"{args.dtype}{' ' + args.quantization if args.quantization else ''}"
    if args.alternate:
        ab = alternate(engine, args.alternate, 10)
        print(f"{label} A/B, median step ms (wall / main-thread CPU): " + ", ".join(f"{k} {w:.2f} / {c:.2f}" for k, (w, c) in ab.items()))
    if args.split and engine.engine_core.executor.worker.model_runner.graphs is None:
        print("--split needs the decode graphs object: drop --enforce-eager")
    elif args.split:
        parts = split(engine, 20)
        print(f"{label} parts, median ms (wall / main-thread CPU): " + ", ".join(f"{k} {w:.2f} / {c:.2f}" for k, (w, c) in parts.items()))
    phases = time_phases(engine, args.steps)
    print(f"{label} {'eager' if args.enforce_eager else 'default'}: step {phases.pop('step'):.2f} ms (median) = "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    if not args.no_profile:
        op_table(engine, args.profile_steps, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
