"""Latency of one batch: time to first token and time per output token.

In the shape of ``vllm bench latency``: a batch of ``--batch-size`` random-token
prompts of ``--input-len`` tokens generates ``--output-len`` tokens each (EOS
ignored). The end-to-end latency and the time to first token (TTFT: until every
request of the batch holds its first token) are taken in the same runs and averaged
over ``--num-iters`` runs after ``--num-iters-warmup``; the time per output token is
``(latency - TTFT) / (output_len - 1)``. Transformers' ``generate`` is the peer, its
first token seen by a streamer.

``--dataset code-edit`` takes chat prompts that ask for a given function back with a
small change (:mod:`runtime.bench.code_edit`) instead, greedy, each answer ending at its
EOS or ``--output-len``: the time per output token then divides by the tokens each request
produced. With speculative decoding (``--speculative-config``) the peer may speculate too:
``--hf-prompt-lookup-num-tokens N`` (prompt lookup) or ``--hf-assistant-model PATH``
(assisted generation with a draft model), both batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

BACKENDS = ("runtime", "hf")


@dataclass
class LatencyResult:
    backend: str
    latency_s: float  # whole batch, output_len tokens
    ttft_s: float  # until every request of the batch holds its first token, in the same runs
    # Speculative decoding: tokens emitted per request and verification step (1 + accepted
    # drafts / drafts, vLLM's mean acceptance length) over the timed runs; None when off.
    acceptance_length: float | None = None
    output_tokens: float | None = None  # mean tokens per request when answers end at EOS

    def tpot_ms(self, output_len: int) -> float:
        tokens = self.output_tokens if self.output_tokens is not None else output_len
        return 1000 * (self.latency_s - self.ttft_s) / max(tokens - 1, 1)


def _mean_times(run: Callable[[int], float], num_tokens: int, iters: int, warmup: int,
                show_progress: bool = False) -> tuple[float, float]:
    """Mean (latency, TTFT) in seconds; ``run`` returns the ``perf_counter`` time its batch's
    first tokens were all out. ``show_progress``: a bar of the runs done on stderr (as vLLM's)."""
    from tqdm import tqdm

    for _ in tqdm(range(warmup), desc="Warmup iterations", disable=not show_progress):
        run(num_tokens)
    latencies, ttfts = [], []
    for _ in tqdm(range(iters), desc="Profiling iterations", disable=not show_progress):
        start = time.perf_counter()
        first = run(num_tokens)
        latencies.append(time.perf_counter() - start)
        ttfts.append(first - start)
    return statistics.fmean(latencies), statistics.fmean(ttfts)


def runtime_runner(args, prompts: list[list[int]]) -> Callable[[int], float]:
    from runtime import LLM, SamplingParams
    from runtime.bench.throughput import engine_kwargs
    from runtime.sampling_params import RequestOutputKind

    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    natural = args.dataset != "random"
    max_model_len = engine.config.model_config.max_model_len
    if not natural and args.input_len + args.output_len > max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} is more than max_model_len "
                         f"{max_model_len}: every request must generate --output-len tokens")

    def run(num_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=not natural, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        counts = {}
        for prompt in prompts:
            request_id = engine.next_request_id()
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            counts[request_id] = 0
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():  # each output holds the tokens new since the last
                counts[output.request_id] += len(output.outputs[0].token_ids)
            if first is None and all(counts.values()):
                first = time.perf_counter()
        assert natural or all(n == num_tokens for n in counts.values()), counts
        run.output_tokens = statistics.fmean(counts.values())
        return first

    run.spec_counts = lambda: spec_decode_counts(llm)
    return run


def spec_decode_counts(llm) -> tuple[int, int] | None:
    """(drafts, accepted draft tokens) so far, from the engine's scheduler stats; None without speculation."""
    stats = getattr(llm.llm_engine, "last_stats", None) or {}
    if "spec_decode_num_drafts" not in stats:
        return None
    return stats["spec_decode_num_drafts"], stats["spec_decode_num_accepted_tokens"]


def mean_acceptance_length(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """1 + accepted / drafts between two counts (vLLM's mean acceptance length); None without
    speculation, NaN when no drafts were proposed."""
    if after is None:
        return None
    drafts = after[0] - (before[0] if before else 0)
    accepted = after[1] - (before[1] if before else 0)
    return 1.0 + accepted / drafts if drafts else float("nan")


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated tokens arrive (its first
    ``put`` is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, _tokens) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        if self.first is None:  # no token came before the end
            self.first = time.perf_counter()


def hf_runner(args, prompts: list[list[int]]) -> Callable[[int], float]:
    import torch

    from runtime.bench.throughput import _hf_model

    model = _hf_model(args)
    ids = torch.tensor(prompts, device=model.device)
    natural = args.dataset != "random"
    speculation = {}
    if args.hf_prompt_lookup_num_tokens:
        speculation["prompt_lookup_num_tokens"] = args.hf_prompt_lookup_num_tokens
    if args.hf_assistant_model:
        from runtime.bench.hf_peer import load_hf_model

        speculation["assistant_model"] = load_hf_model(args.hf_assistant_model, model.dtype, False, args.seed)
    if speculation and len(prompts) != 1:
        raise ValueError(f"transformers speculates for one request at a time: --batch-size must be 1, got {len(prompts)}")

    @torch.inference_mode()
    def run(num_tokens: int) -> float:
        stop = {} if natural else {"min_new_tokens": num_tokens}
        timer = _FirstTokenTimer()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             do_sample=False, pad_token_id=0, streamer=timer, **stop, **speculation)
        run.output_tokens = out.shape[1] - ids.shape[1]
        return timer.first

    return run


def measure(args, backend: str, prompts: list[list[int]]) -> LatencyResult:
    run = (runtime_runner if backend == "runtime" else hf_runner)(args, prompts)
    spec_counts = getattr(run, "spec_counts", lambda: None)
    before = spec_counts()
    latency, ttft = _mean_times(run, args.output_len, args.num_iters, args.num_iters_warmup, not args.disable_tqdm)
    acceptance = mean_acceptance_length(before, spec_counts())
    output_tokens = run.output_tokens if args.dataset != "random" else None  # greedy: every run the same
    return LatencyResult(backend, latency, ttft, acceptance, output_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from runtime.cli.args import add_engine_args

    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--backends", default="runtime", help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--hf-dtype", default=None, help="dtype of the transformers peer (default: --dtype)")
    parser.add_argument("--dataset", choices=("random", "code-edit"), default="random",
                        help="random token prompts of --input-len (EOS ignored), or code-editing chats answered until EOS")
    parser.add_argument("--hf-prompt-lookup-num-tokens", type=int, default=0,
                        help="the transformers peer speculates by prompt lookup with this many tokens (batch 1)")
    parser.add_argument("--hf-assistant-model", default=None,
                        help="the transformers peer speculates with this draft model (assisted generation, batch 1)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar of the runs done")
    add_engine_args(parser)


def register(sub) -> None:
    parser = sub.add_parser("latency", help="time to first token and per output token of one batch")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    import random

    from runtime.model_loader import resolve_model

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if not backends:
        raise ValueError(f"--backends names none; choose from {', '.join(BACKENDS)}")
    if args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 to measure time per output token, got {args.output_len}")
    for flag, least in (("input_len", 1), ("batch_size", 1), ("num_iters", 1), ("num_iters_warmup", 0)):
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if not args.model:
        from runtime.cli.serve import default_model_path

        args.model = default_model_path()
    if args.dataset == "code-edit":
        from runtime.bench.code_edit import code_edit_prompts

        prompts = code_edit_prompts(args.model, args.batch_size, args.trust_remote_code)
        shape = f"code-editing chats of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, answers up to {args.output_len}"
    else:
        vocab = int(resolve_model(args.model).hf_config.vocab_size)
        rng = random.Random(args.seed)
        low_id = min(100, vocab // 2)
        prompts = [[rng.randrange(low_id, vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
        shape = f"{args.input_len} prompt + {args.output_len} output tokens"
    results = [measure(args, b, prompts) for b in backends]
    print(f"\nbatch {args.batch_size} x ({shape}), mean of {args.num_iters} runs")
    print(f"{'backend':<10} {'latency s':>10} {'TTFT ms':>9} {'TPOT ms':>9} {'tokens':>7}")
    for r in results:
        tokens = r.output_tokens if r.output_tokens is not None else args.output_len
        print(f"{r.backend:<10} {r.latency_s:>10.3f} {1000 * r.ttft_s:>9.2f} {r.tpot_ms(args.output_len):>9.2f} {tokens:>7.1f}")
    for r in results:
        if r.acceptance_length is None:
            continue
        if r.acceptance_length != r.acceptance_length:  # NaN
            print(f"{r.backend}: speculative decoding, mean acceptance length n/a (no drafts were proposed)")
        else:
            print(f"{r.backend}: speculative decoding, mean acceptance length {r.acceptance_length:.2f} "
                  "(tokens per request and verification step: 1 + accepted drafts / drafts)")
    return 0
