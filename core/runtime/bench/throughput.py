"""Offline throughput: this engine and Hugging Face transformers on the same requests.

In the shape of ``vllm bench throughput``: random-token prompts with lengths drawn
from a range, a per-request output length, ``ignore_eos`` so every request runs
to its length. Prints requests/s, total tokens/s and output tokens/s per system.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

BACKENDS = ("runtime", "hf", "hf-batch")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    backend: str
    num_requests: int
    elapsed_s: float
    requests_per_s: float
    total_tokens_per_s: float
    output_tokens_per_s: float


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"a length range is 'MIN,MAX' (or one number) with 0 < MIN <= MAX, got {text!r}") from None
    if not 0 < lo_i <= hi_i:
        raise ValueError(f"a length range is 'MIN,MAX' with 0 < MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def make_workload(num_requests: int, input_range, output_range, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # Skip the first ids: they are often special tokens.
    low_id = min(100, vocab_size // 2)
    prompts = [[rng.randrange(low_id, vocab_size) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def run_runtime(args, workload: Workload) -> float:
    from runtime import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    max_model_len = llm.llm_engine.config.model_config.max_model_len
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    if longest > max_model_len:
        raise ValueError(f"a request of {longest} tokens (prompt + output, from --input-len {args.input_len} and "
                         f"--output-len {args.output_len}) is more than max_model_len {max_model_len}: every request "
                         "must generate its output length")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[: min(4, len(prompts))], params[:4], use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return elapsed


def engine_kwargs(args) -> dict:
    from runtime.cli.args import engine_args_from_namespace

    engine_args = engine_args_from_namespace(args)
    return {k: v for k, v in asdict(engine_args).items()}


def _hf_model(args):
    from runtime.bench.hf_peer import load_hf_model

    name = args.hf_dtype or args.dtype
    if name == "auto":  # the engine's choice, so that both run the same precision (GGUF files name none)
        from runtime.engine_args import resolve_dtype
        from runtime.model_loader import resolve_model
        from runtime.platforms import select_platform

        dtype = resolve_dtype(name, resolve_model(args.model), select_platform(args.platform))
    else:  # vLLM's names and aliases ("half", "float"), checked
        from runtime.config import parse_dtype

        dtype = parse_dtype(name, None)
    return load_hf_model(args.model, dtype, args.load_format == "dummy", args.seed)


def run_hf(args, workload: Workload, batched: bool) -> float:
    from runtime.bench.hf_peer import hf_generate_batch, hf_generate_padded

    model = _hf_model(args)
    if batched:
        return hf_generate_batch(model, workload, args.hf_max_batch_tokens, not args.quiet)
    return hf_generate_padded(model, workload, args.hf_batch_size, not args.quiet)


def report(name: str, workload: Workload, elapsed: float) -> Result:
    n = len(workload.prompts)
    total = workload.num_prompt_tokens + workload.num_output_tokens
    return Result(name, n, elapsed, n / elapsed, total / elapsed, workload.num_output_tokens / elapsed)


def register(sub) -> None:
    parser = sub.add_parser("throughput", help="offline throughput against Hugging Face transformers")
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from runtime.cli.args import add_engine_args

    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="16,256", help="prompt length range MIN,MAX (random tokens)")
    parser.add_argument("--output-len", default="16,256", help="output length range MIN,MAX")
    parser.add_argument("--backends", default="runtime,hf", help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="padded batch size of transformers generate")
    parser.add_argument("--hf-max-batch-tokens", type=int, default=2048, help="token budget of transformers generate_batch")
    parser.add_argument("--hf-dtype", default=None, help="dtype of the transformers peer (default: --dtype)")
    parser.add_argument(
        "--hf-num-prompts", type=int, default=None,
        help="run the transformers peers on only the first N requests (when the whole workload would take hours)",
    )
    parser.add_argument(
        "--structured-output", default=None, choices=("json",),
        help="constrain every request by one of a fixed set of JSON schemas and compare with the same tokens unconstrained",
    )
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--quiet", action="store_true")
    add_engine_args(parser)


def main(args) -> int:
    from runtime.model_loader import resolve_model

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if not backends:
        raise ValueError(f"--backends names none; choose from {', '.join(BACKENDS)}")
    for flag in ("num_prompts", "hf_batch_size", "hf_max_batch_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    input_range, output_range = parse_range(args.input_len), parse_range(args.output_len)
    if not args.model:
        from runtime.cli.serve import default_model_path

        args.model = default_model_path()
    vocab = int(resolve_model(args.model).hf_config.vocab_size)
    workload = make_workload(args.num_prompts, input_range, output_range, vocab, args.seed)
    peer_workload = workload
    if args.hf_num_prompts is not None:
        n = args.hf_num_prompts
        if not 0 < n <= len(workload.prompts):
            raise ValueError(f"--hf-num-prompts must be in 1..{len(workload.prompts)} (--num-prompts), got {n}")
        peer_workload = Workload(workload.prompts[:n], workload.output_lens[:n])
    if args.structured_output:
        return main_structured(args, workload, peer_workload, backends)
    runners = {
        "runtime": lambda: (workload, run_runtime(args, workload)),
        "hf": lambda: (peer_workload, run_hf(args, peer_workload, batched=False)),
        "hf-batch": lambda: (peer_workload, run_hf(args, peer_workload, batched=True)),
    }
    results = [report(b, *runners[b]()) for b in backends]
    print(f"\n{len(workload.prompts)} requests, {workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens")
    if peer_workload is not workload:
        print(f"transformers peers: the first {len(peer_workload.prompts)} requests, "
              f"{peer_workload.num_prompt_tokens} prompt + {peer_workload.num_output_tokens} output tokens")
    print(f"{'backend':<10} {'requests':>8} {'time s':>8} {'req/s':>8} {'total tok/s':>12} {'output tok/s':>13}")
    for r in results:
        print(f"{r.backend:<10} {r.num_requests:>8} {r.elapsed_s:>8.2f} {r.requests_per_s:>8.2f} "
              f"{r.total_tokens_per_s:>12.1f} {r.output_tokens_per_s:>13.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def main_structured(args, workload: Workload, peer_workload: Workload, backends: list[str]) -> int:
    from runtime.bench import structured

    if "runtime" not in backends:
        raise ValueError("--structured-output compares runs of this engine: include 'runtime' in --backends")
    result = structured.run_runtime_structured(args, workload, engine_kwargs(args))
    structured.print_report(result, None, len(workload.prompts))  # before the (slow) peer runs
    hf_s = None
    if "hf" in backends:
        from runtime.model_loader import get_tokenizer, resolve_model

        tokenizer = get_tokenizer(resolve_model(args.model))
        n = len(peer_workload.prompts)
        hf_s = structured.run_hf_structured(args, peer_workload, _hf_model(args), tokenizer, result["lengths"][:n])
        hf_s *= len(workload.prompts) / n  # scaled to the whole workload when it ran on a subset
        structured.print_report(result, hf_s, len(workload.prompts))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**result, "hf_s": hf_s}, f, indent=2)
    return 0
