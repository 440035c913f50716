"""The engine's own time per step, outside the model.

Runs a tiny dummy Llama with many concurrent decoding requests and splits each
``LLMEngine.step()`` into model time (forward, logits, sampling) and everything
else (scheduling, input preparation, output handling and detokenizing).
"""

from __future__ import annotations

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
    """Accumulates wall time of wrapped callables."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return timed


def measure(num_requests: int = 256, prompt_len: int = 32, output_len: int = 64, warmup_steps: int = 5) -> dict:
    from runtime import RequestOutputKind, SamplingParams
    from runtime.config import EngineArgs
    from runtime.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=tiny_config_folder(), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
        max_num_seqs=num_requests, max_num_batched_tokens=max(num_requests * prompt_len, 8192), max_model_len=1024,
    )
    engine = LLMEngine.from_engine_args(args)
    runner = engine.engine_core.executor.worker.model_runner
    timer = _Timer()
    runner.model.forward = timer.wrap(runner.model.forward)
    runner.model.compute_logits = timer.wrap(runner.model.compute_logits)
    runner.sampler.forward = timer.wrap(runner.sampler.forward)
    # As LLM.generate does: only finished outputs are built.
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(num_requests):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 7 + j) % 2000 + 10 for j in range(prompt_len)]}, params)
    overheads, totals = [], []
    step = 0
    while engine.has_unfinished_requests():
        timer.total = 0.0
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        step += 1
        running = engine.engine_core.scheduler.stats()["num_running"]
        if step > warmup_steps and running == num_requests:
            totals.append(elapsed)
            overheads.append(elapsed - timer.total)
    return {
        "num_running": num_requests,
        "steps_measured": len(overheads),
        "median_step_ms": 1000 * statistics.median(totals),
        "median_overhead_ms": 1000 * statistics.median(overheads),
        "mean_overhead_ms": 1000 * statistics.fmean(overheads),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)


def register(sub) -> None:
    parser = sub.add_parser("step-overhead", help="engine time per step outside the model")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    result = measure(args.num_requests, output_len=args.output_len)
    print(
        f"{result['num_running']} running requests, {result['steps_measured']} decode steps: "
        f"step {result['median_step_ms']:.2f} ms median, outside the model {result['median_overhead_ms']:.2f} ms median "
        f"({result['mean_overhead_ms']:.2f} ms mean)"
    )
    return 0
