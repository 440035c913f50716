"""Cost of one speculative verification step (1 + k tokens per request) against a plain decode step.

Issue 13's GPU target: at batch 1 a verification step of 1 + 4 tokens costs at most 1.15x a
plain decode step, at batch 64 at most 1.5x. Dummy weights give no real acceptance, so the
proposer is replaced by one that always drafts k tokens: every step then verifies exactly
1 + k tokens per request (almost all rejected, which changes nothing in the step's cost).

    python benchmarks/spec_verify_step.py --model benchmarks/configs/llama-3.1-8b --batch-sizes 1 64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from runtime import LLM, SamplingParams
from runtime.spec_decode import DraftProposals


class AlwaysDraft:
    """A proposer that drafts ``k`` copies of each request's last token."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, batch) -> DraftProposals:
        return DraftProposals([[ids[-1]] * self.k for ids in batch.token_ids])


def time_per_step(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, int]:
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 30000 for j in range(prompt_len)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm up (and fill the prefix cache: prefill is then one step)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    engine.step()  # the (cached) prefill step
    steps, start = 0, None
    while engine.has_unfinished_requests():
        if steps == 2:
            start = time.perf_counter()  # skip the first decode steps (graph warm-up, first drafts)
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / (steps - 2), steps


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    common = dict(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
                  enable_prefix_caching=True, disable_log_stats=True, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=8 << 30)
    plain = LLM(**common)
    rows = []
    for batch in args.batch_sizes:
        rows.append(("decode (graphs)", batch, *time_per_step(plain, batch, args.prompt_len, args.new_tokens)))
    del plain
    release()
    eager = LLM(enforce_eager=True, **common)
    for batch in args.batch_sizes:
        rows.append(("decode (eager)", batch, *time_per_step(eager, batch, args.prompt_len, args.new_tokens)))
    del eager
    release()
    for label, eager_flag in ((f"verify 1+{args.k} (graphs)", False), (f"verify 1+{args.k} (eager)", True)):
        spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, enforce_eager=eager_flag, **common)
        spec.llm_engine.engine_core.proposer = AlwaysDraft(args.k)
        for batch in args.batch_sizes:
            # Each step emits 1 token (drafts rejected), so the same number of steps as decoding.
            rows.append((label, batch, *time_per_step(spec, batch, args.prompt_len, args.new_tokens)))
        del spec
        release()
    print(f"\n{'step':<22} {'batch':>5} {'ms/step':>9} {'steps':>6} {'vs graphs':>10}")
    base = {b: t for name, b, t, _ in rows if name == "decode (graphs)"}
    for name, batch, t, steps in rows:
        print(f"{name:<22} {batch:>5} {t * 1e3:>9.3f} {steps:>6} {t / base[batch]:>9.2f}x")
    print(json.dumps([dict(step=n, batch=b, ms=t * 1e3) for n, b, t, _ in rows]))


if __name__ == "__main__":
    main()
