"""Time the prefix-cache block hashes of one long prompt, as the KV cache manager computes them.

    python benchmarks/block_hash_bench.py --prompt-len 8192 --block-size 16

Prints the best of ``--repeats`` runs for the whole prompt (what a new request pays once,
at its first lookup) and per block (what a decode step pays when it fills a block).
"""

from __future__ import annotations

import argparse
import random
import time

from runtime.sampling_params import SamplingParams
from runtime.scheduler.kv_cache_manager import KVCacheManager
from runtime.scheduler.request import Request


def time_prompt_hashes(prompt_len: int, block_size: int, repeats: int) -> float:
    """Best wall time, in seconds, to hash every full block of a random prompt."""
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(prompt_len)]
    manager = KVCacheManager(num_blocks=1, block_size=block_size, enable_caching=True)
    best = float("inf")
    for i in range(repeats):
        request = Request(f"r{i}", tokens, SamplingParams())
        start = time.perf_counter()
        manager._update_block_hashes(request)
        best = min(best, time.perf_counter() - start)
        assert len(request.block_hashes) == prompt_len // block_size
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    seconds = time_prompt_hashes(args.prompt_len, args.block_size, args.repeats)
    num_blocks = args.prompt_len // args.block_size
    print(
        f"{args.prompt_len} tokens, {num_blocks} blocks of {args.block_size}: "
        f"{seconds * 1e3:.3f} ms per prompt, {seconds / num_blocks * 1e6:.2f} us per block"
    )


if __name__ == "__main__":
    main()
