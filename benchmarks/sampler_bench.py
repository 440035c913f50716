"""GPU time of the sampler on one decode step's logits: sort-based filters against the
platform's sort-free top-k + top-p (``runtime_kernels.sampling.top_k_top_p_bounded``).

    python3 benchmarks/sampler_bench.py --rows 64 256 --vocab 151936 128256

Logits are random with a Zipf-like spread (what matters here is the row length, not the
values). Prints microseconds per sampler call for greedy rows, top-k + top-p rows with
and without the op, and top-p-only rows (always sorted).
"""

from __future__ import annotations

import argparse
import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

from cuda_timing import cuda_ms  # noqa: E402
from runtime.models.ops import custom_ops_scope  # noqa: E402
from runtime.sample import Sampler, build_sampling_metadata  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime_kernels.sampling import top_k_top_p_bounded  # noqa: E402

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "top_k=50 top_p=0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_k=1000 top_p=0.95": SamplingParams(temperature=0.8, top_k=1000, top_p=0.95),
    "top_p=0.9 (no top_k)": SamplingParams(temperature=0.8, top_p=0.9),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 128256])
    args = parser.parse_args()
    with custom_ops_scope({"top_k_top_p": top_k_top_p_bounded}):
        fused = Sampler()
    plain = Sampler()
    print(f"{'vocab':>7} {'rows':>5} {'case':24} {'sort us':>9} {'op us':>9}")
    for vocab, rows in itertools.product(args.vocab, args.rows):
        ranks = torch.rand(rows, vocab, device="cuda").argsort(dim=1).float() + 1
        logits = -1.1 * ranks.log() * 4
        for label, params in CASES.items():
            metadata = build_sampling_metadata([params] * rows, [[0]] * rows, [[]] * rows, [None] * rows, vocab, logits.device)
            sort_ms = cuda_ms(lambda: plain(logits, metadata))
            op_ms = cuda_ms(lambda: fused(logits, metadata))
            print(f"{vocab:7d} {rows:5d} {label:24} {sort_ms * 1000:9.1f} {op_ms * 1000:9.1f}")


if __name__ == "__main__":
    main()
