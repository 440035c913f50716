"""The CPU plugin's ``cpu_paged`` against core's reference ``sdpa`` backend, on the CPU.

    python benchmarks/cpu_attention.py micro                 # attention only, SmolLM2-135M's shapes
    python benchmarks/cpu_attention.py e2e decode-shared-prefix decode-short prefill

``micro`` times one step (``build_metadata`` + 30 layers' ``forward``) of each case; the
backends alternate ``--rounds`` times and the fastest run of each counts (the machine is
shared). ``e2e`` loads the default model (bfloat16) once per backend in one process and
alternates ``generate()`` calls the same way. The two backends share every prefill path
(``cpu_paged`` replaces only the decode), so prefill cases are an A/A control of the noise.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata
from runtime.attention.sdpa import SdpaAttentionBackend

BACKENDS = ("sdpa", "cpu_paged")
BLOCK, HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 16, 9, 3, 64, 30  # SmolLM2-135M
_lens = random.Random(1)
MICRO_CASES = {  # name: (query lengths, sequence lengths) of one step
    "decode, 64 requests, context 128-512": ([1] * 64, [_lens.randint(128, 512) for _ in range(64)]),
    "decode, 128 requests, context 16-512": ([1] * 128, [_lens.randint(16, 512) for _ in range(128)]),
    "prefill, 4 prompts of 256": ([256] * 4, [256] * 4),
    "prefill, 4 chunks of 128 over 256 cached": ([128] * 4, [384] * 4),
}


def backend(name: str):
    if name == "sdpa":
        return SdpaAttentionBackend()
    from runtime_cpu.attention import CPUPagedAttentionBackend

    return CPUPagedAttentionBackend()


def micro_step(q_lens: list[int], seq_lens: list[int], seed: int = 0):
    """Metadata over shuffled blocks, a random bf16 cache and one step's q, k, v."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, q, s in zip(tables, q_lens, seq_lens) for p in range(s - q, s)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        num_reqs=len(q_lens), num_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32), block_size=BLOCK,
    )
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    n = int(qsl[-1])
    q, k, v = (torch.randn(n, h, HEAD_SIZE, generator=gen).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    return metadata, cache, q, k, v


def time_micro(name: str, metadata, cache, q, k, v) -> float:
    layer = AttentionLayerSpec(0, HEADS, KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)
    attention = backend(name)
    metadata.backend_data = None
    start = time.perf_counter()
    with torch.inference_mode():
        attention.build_metadata(metadata)
        for _ in range(LAYERS):
            attention.forward(layer, q, k, v, cache, metadata)
    return time.perf_counter() - start


def e2e_workload(name: str):
    """(prompts, sampling params, prefix caching) of an end-to-end workload."""
    from runtime import SamplingParams

    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    def greedy(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    if name == "decode-shared-prefix":  # 64 requests: a 320-token system prompt + 8 own tokens, 64 new tokens
        prefix = ids(320)
        return [prefix + ids(8) for _ in range(64)], [greedy(64)] * 64, True
    if name == "decode-short":  # 32 requests: prompts of 16-64 tokens, 96-128 new tokens
        return [ids(rng.randint(16, 64)) for _ in range(32)], [greedy(rng.randint(96, 128)) for _ in range(32)], False
    if name == "prefill":  # 8 prompts of 384-512 tokens, one new token
        return [ids(rng.randint(384, 512)) for _ in range(8)], [greedy(1)] * 8, False
    raise ValueError(f"unknown workload {name!r}; choose from decode-shared-prefix, decode-short, prefill")


def run_e2e(workloads: list[str], rounds: int) -> None:
    from runtime import LLM
    from runtime.cli.serve import default_model_path

    model = default_model_path()
    for workload in workloads:
        prompts, params, caching = e2e_workload(workload)
        requests = [{"prompt_token_ids": p} for p in prompts]
        engines = {b: LLM(model, dtype="bfloat16", attention_backend=b, enable_prefix_caching=caching) for b in BACKENDS}
        for llm in engines.values():
            llm.generate(requests[:1], params[:1], use_tqdm=False)  # warm up (and cache a shared prefix)
        best = {b: float("inf") for b in BACKENDS}
        for r in range(rounds):
            for b, llm in engines.items():
                start = time.perf_counter()
                llm.generate(requests, params, use_tqdm=False)
                best[b] = min(best[b], time.perf_counter() - start)
                print(f"  {workload} round {r} {b}: {time.perf_counter() - start:.2f} s", flush=True)
        tokens = sum(len(p) for p in prompts) + sum(p.max_tokens for p in params)
        figures = "; ".join(f"{b} {best[b]:.2f} s = {tokens / best[b]:.1f} tok/s" for b in BACKENDS)
        print(f"{workload}: {figures}; sdpa / cpu_paged time = {best['sdpa'] / best['cpu_paged']:.2f}", flush=True)
        del engines


def run_micro(rounds: int) -> None:
    for name, (q_lens, seq_lens) in MICRO_CASES.items():
        step = micro_step(q_lens, seq_lens)
        best = {b: float("inf") for b in BACKENDS}
        for _ in range(rounds):
            for b in BACKENDS:
                best[b] = min(best[b], time_micro(b, *step))
        figures = ", ".join(f"{b} {best[b] * 1e3:.1f} ms" for b in BACKENDS)
        print(f"{name}: {figures} per step ({LAYERS} layers); sdpa / cpu_paged = {best['sdpa'] / best['cpu_paged']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["micro", "e2e"])
    parser.add_argument("workloads", nargs="*", default=["decode-shared-prefix", "decode-short", "prefill"])
    parser.add_argument("--rounds", type=int, default=None, help="alternations (default: micro 7, e2e 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # one thread: a shared machine slows each op less unevenly
    if args.mode == "micro":
        run_micro(args.rounds or 7)
    else:
        run_e2e(args.workloads, args.rounds or 3)


if __name__ == "__main__":
    main()
