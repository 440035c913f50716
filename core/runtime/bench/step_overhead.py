"""The engine's own time per step, outside the model.

Runs a tiny dummy Llama with many concurrent decoding requests and splits each
``LLMEngine.step()`` into model time (forward, logits, sampling) and everything
else (scheduling, input preparation, output handling and detokenizing).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time


def tiny_config_folder(hidden: int = 64, layers: int = 2, vocab: int = 2048) -> str:
    from transformers import LlamaConfig

    folder = tempfile.mkdtemp(prefix="runtime-tiny-")
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ).save_pretrained(folder)
    return folder


class _Timer:
    """Accumulates wall time of wrapped callables (a call inside another wrapped one counts once)."""

    def __init__(self):
        self.total = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.total += time.perf_counter() - start

        return timed


def _wrap_parts(engine) -> tuple[_Timer, dict[str, _Timer]]:
    """Time the model (forward, logits, sampling) and the engine's own parts around it."""
    core, runner = engine.engine_core, engine.engine_core.executor.worker.model_runner
    model = _Timer()
    runner.model.forward = model.wrap(runner.model.forward)
    if runner.graphs is not None:  # decode steps run compiled code or replay graphs, not model.forward
        runner.graphs.run = model.wrap(runner.graphs.run)
    runner.model.compute_logits = model.wrap(runner.model.compute_logits)
    runner.sampler.forward = model.wrap(runner.sampler.forward)
    parts = {"schedule": _Timer(), "update_from_output": _Timer(), "output processor": _Timer()}
    core.scheduler.schedule = parts["schedule"].wrap(core.scheduler.schedule)
    core.scheduler.update_from_output = parts["update_from_output"].wrap(core.scheduler.update_from_output)
    engine.output_processor.process_outputs = parts["output processor"].wrap(engine.output_processor.process_outputs)
    return model, parts


def _make_engine(num_requests: int, prompt_len: int, cpu_num_threads: int | None):
    from runtime.engine_args import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=tiny_config_folder(), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
        max_num_seqs=num_requests, max_num_batched_tokens=max(num_requests * prompt_len, 8192), max_model_len=1024,
        cpu_num_threads=cpu_num_threads,
    )
    return LLMEngine.from_engine_args(args)


def _add_requests(engine, num_requests: int, prompt_len: int, output_len: int) -> None:
    from runtime import RequestOutputKind, SamplingParams

    # As LLM.generate does: only finished outputs are built.
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(num_requests):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 7 + j) % 2000 + 10 for j in range(prompt_len)]}, params)


def measure(
    num_requests: int = 256,
    prompt_len: int = 32,
    output_len: int = 64,
    warmup_steps: int = 5,
    profile: int = 0,
    cpu_num_threads: int | None = None,
    show_progress: bool = False,
) -> dict:
    """Median step times at ``num_requests`` running requests; ``profile > 0`` prints the
    top ``profile`` functions (cProfile, by own time) over the measured steps.

    ``cpu_num_threads=1`` keeps torch ops from waiting on a busy second core, which
    makes the figures far steadier on a machine shared with other jobs. ``show_progress``:
    a bar of the steps run (one token per request each), on stderr.
    """
    from tqdm import tqdm

    # Measured: the steps after the warm-up ones that leave every request running (the last step ends them).
    least = warmup_steps + 2
    if num_requests < 1 or output_len < least:
        raise ValueError(f"--num-requests must be >= 1 and --output-len >= {least} ({warmup_steps} warm-up steps, then "
                         f"measured ones before the last), got {num_requests} and {output_len}")
    engine = _make_engine(num_requests, prompt_len, cpu_num_threads)
    model, parts = _wrap_parts(engine)
    _add_requests(engine, num_requests, prompt_len, output_len)
    profiler = cProfile.Profile() if profile else None
    overheads, totals, part_times = [], [], {name: [] for name in parts}
    step = 0
    progress = tqdm(total=output_len, desc="decode steps", unit="step", disable=not show_progress)
    while engine.has_unfinished_requests():
        for timer in (model, *parts.values()):
            timer.total = 0.0
        measured = step >= warmup_steps and engine.engine_core.scheduler.stats()["num_running"] == num_requests
        if profiler is not None and measured:
            profiler.enable()
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        step += 1
        progress.update(min(1, output_len - progress.n))  # a token per request and step (the prompts fit one step)
        # Measured: every request was running before the step and still is after it.
        if measured and engine.engine_core.scheduler.stats()["num_running"] == num_requests:
            totals.append(elapsed)
            overheads.append(elapsed - model.total)
            for name, timer in parts.items():
                part_times[name].append(timer.total)
    progress.close()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    return {
        "num_running": num_requests,
        "steps_measured": len(overheads),
        "median_step_ms": 1000 * statistics.median(totals),
        "median_overhead_ms": 1000 * statistics.median(overheads),
        "mean_overhead_ms": 1000 * statistics.fmean(overheads),
        "median_part_ms": {name: 1000 * statistics.median(times) for name, times in part_times.items()},
    }


def add_arguments(parser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N functions (cProfile)")
    parser.add_argument("--cpu-num-threads", type=int, default=None, help="torch threads (default: the platform's)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar of the decode steps")


def register(sub) -> None:
    parser = sub.add_parser("step-overhead", help="engine time per step outside the model")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    result = measure(
        args.num_requests, output_len=args.output_len, profile=args.profile, cpu_num_threads=args.cpu_num_threads,
        show_progress=not args.disable_tqdm,
    )
    print(
        f"{result['num_running']} running requests, {result['steps_measured']} decode steps: "
        f"step {result['median_step_ms']:.2f} ms median, outside the model {result['median_overhead_ms']:.2f} ms median "
        f"({result['mean_overhead_ms']:.2f} ms mean)"
    )
    parts = ", ".join(f"{name} {ms:.2f}" for name, ms in result["median_part_ms"].items())
    print(f"outside the model, medians of its parts (ms): {parts}; the rest is the worker's input and sampling preparation")
    return 0
