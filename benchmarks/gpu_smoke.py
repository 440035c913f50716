"""GPU smoke test and micro-benchmark of runtime-kernels and the CUDA attention backends.

Run on a CUDA machine with the project installed (runtime, runtime-kernels,
runtime-plugin-cuda):

    python3 benchmarks/gpu_smoke.py

1. Correctness at realistic shapes, compiled (no interpreter): every kernel against its
   plain-torch reference, and both attention backends; prints the max error per check.
2. Timing: the ``triton`` backend against the ``sdpa`` backend for a decode batch
   (256 sequences x 1024 context, Qwen3-0.6B shapes: 16 query heads, 8 kv heads,
   head 128, bf16) and a prefill, next to dense flash SDPA (no paging) as a yardstick;
   plus the top-k/top-p filter against the sort-based one.

Logs go to ``$OUT/gpu_smoke.log`` and ``$OUT/gpu_smoke.json`` when ``OUT`` is set.
Exits 1 when a check fails.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cuda_timing import cuda_ms  # noqa: E402
from runtime.attention.backend import AttentionLayerSpec, AttentionMetadata  # noqa: E402

LINES: list[str] = []
RESULTS: dict[str, list] = {"checks": [], "timings": []}


def log(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


# ------------------------------------------------------------------ batches
def make_step(requests, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """A step over ``requests`` [(cached, new)]: metadata, q/k/v and a cache holding the context."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in requests]
    blocks_per = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 1
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables, offset = [], 0
    for n in blocks_per:
        tables.append(perm[offset : offset + n])
        offset += n
    width = max(blocks_per)
    table = torch.zeros(len(requests), width, dtype=torch.int32, device="cuda")
    for i, t in enumerate(tables):
        table[i, : len(t)] = t.int()
    slots = torch.cat([
        tables[i][torch.arange(c, c + q, device="cuda") // block_size].long() * block_size
        + torch.arange(c, c + q, device="cuda") % block_size
        for i, (c, q) in enumerate(requests)
    ])
    q_lens = [q for _, q in requests]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    metadata = AttentionMetadata(
        num_reqs=len(requests), num_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl).cuda(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32), block_size=block_size,
    )
    n = int(qsl[-1])

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    cache = rand(2, num_blocks, block_size, num_kv_heads, head_size)
    return metadata, rand(n, num_heads, head_size), rand(n, num_kv_heads, head_size), rand(n, num_kv_heads, head_size), cache


# ------------------------------------------------------------------ checks
def check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Max of ``|got - expected| / (1 + |expected|)``: absolute near 0, relative for large values."""
    diff = (got.float() - expected.float()).abs() / (1 + expected.float().abs())
    err = diff.max().item() if got.numel() else 0.0
    ok = err <= tol and not math.isnan(err)
    log(f"  {'ok  ' if ok else 'FAIL'} {name:<62} max err {err:.3e} (tol {tol:.0e})")
    RESULTS["checks"].append({"name": name, "max_err": err, "tol": tol, "ok": ok})
    return ok


def check_attention(label, requests, heads, kv_heads, head, block, dtype, window=None, softcap=None) -> bool:
    from runtime.attention.sdpa import SdpaAttentionBackend
    from runtime_kernels.attention_backend import TritonAttentionBackend
    from runtime_kernels.attention import unified_attention_ref

    spec = AttentionLayerSpec(0, heads, kv_heads, head, head**-0.5, window, softcap)
    ok = True
    for backend in (TritonAttentionBackend(), SdpaAttentionBackend()):
        metadata, q, k, v, cache = make_step(requests, heads, kv_heads, head, block, dtype)
        expected_cache = cache.clone()
        flat = expected_cache.view(2, -1, kv_heads, head)
        flat[0, metadata.slot_mapping], flat[1, metadata.slot_mapping] = k, v
        expected = unified_attention_ref(q, expected_cache[0], expected_cache[1], metadata.query_start_loc,
                                         metadata.seq_lens, metadata.block_table, spec.scale, window, softcap)
        out = backend.forward(spec, q, k, v, cache, backend.build_metadata(metadata))
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        ok &= check(f"attention/{backend.name} {label}", out, expected, tol)
        ok &= check(f"kv cache write/{backend.name} {label}", cache, expected_cache, 0.0)
    return ok


def check_elementwise() -> bool:
    from runtime_kernels.activation import silu_and_mul, silu_and_mul_ref
    from runtime_kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
    from runtime_kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref

    ok = True
    x, r = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).bfloat16()
    ok &= check("rms_norm bf16 [8192, 1024]", rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), 3e-2)
    ok &= check("rms_norm gemma bf16 [8192, 1024]", rms_norm(x, w, 1e-6, True), rms_norm_ref(x, w, 1e-6, True), 3e-2)
    (out, summed), (ref_out, ref_summed) = fused_add_rms_norm(x, r, w, 1e-6), fused_add_rms_norm_ref(x, r, w, 1e-6)
    ok &= check("fused_add_rms_norm bf16 out", out, ref_out, 3e-2) & check("fused_add_rms_norm residual", summed, ref_summed, 0.0)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cos_sin = build_cos_sin_cache(llama3, 128, 32768, "cuda")
    positions = torch.randint(0, 32768, (4096,), device="cuda")
    q, k = torch.randn(4096, 32, 128, device="cuda").bfloat16(), torch.randn(4096, 8, 128, device="cuda").bfloat16()
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cos_sin)
    rotary_embedding(positions, q, k, cos_sin)
    ok &= check("rotary llama3 bf16 q [4096, 32, 128]", q, ref_q, 2e-2) & check("rotary llama3 bf16 k", k, ref_k, 2e-2)
    g = torch.randn(8192, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    ok &= check("silu_and_mul bf16 [8192, 2 x 3072]", silu_and_mul(g), silu_and_mul_ref(g), 3e-2)
    return ok


def check_sampling() -> bool:
    from runtime_kernels.sampling import top_k_top_p_filter, top_k_top_p_filter_ref

    logits = torch.randn(256, 151936, device="cuda") * 4
    top_k = torch.randint(0, 200, (256,), device="cuda")
    top_p = torch.rand(256, device="cuda") * 0.5 + 0.5
    got, expected = top_k_top_p_filter(logits, top_k, top_p), top_k_top_p_filter_ref(logits, top_k, top_p)
    rows_differ = int((got.isinf() != expected.isinf()).any(dim=1).sum())
    ok = rows_differ <= 2  # float rounding at the top-p boundary may flip a token in rare rows
    log(f"  {'ok  ' if ok else 'FAIL'} top_k_top_p_filter [256, 151936]: {rows_differ} rows keep a different set")
    RESULTS["checks"].append({"name": "top_k_top_p_filter", "rows_differ": rows_differ, "ok": ok})
    return ok


def run_checks() -> bool:
    log("== correctness (compiled kernels vs plain-torch references)")
    mixed = [(0, 300), (700, 129), (0, 1)] + [(c, 1) for c in range(37, 2000, 61)]
    ok = check_attention("qwen3 16/8x128 bf16 mixed", mixed, 16, 8, 128, 16, torch.bfloat16)
    ok &= check_attention("qwen3 16/8x128 fp32 mixed", mixed, 16, 8, 128, 16, torch.float32)
    ok &= check_attention("llama 32/8x64 bf16 mixed", mixed, 32, 8, 64, 16, torch.bfloat16)
    ok &= check_attention("gemma 4/1x256 bf16 window 512 softcap 50", mixed, 4, 1, 256, 16, torch.bfloat16, 512, 50.0)
    ok &= check_attention("qwen2 14/2x64 fp16 block 32 window 100", mixed, 14, 2, 64, 32, torch.float16, 100)
    ok &= check_attention("qwen3 decode 4 x 8000 ctx (split-KV)", [(7999, 1)] * 4, 16, 8, 128, 16, torch.bfloat16)
    ok &= check_elementwise()
    ok &= check_sampling()
    return ok


# ------------------------------------------------------------------ timings
def time_backends(label: str, requests, kv_bytes: int) -> None:
    from runtime.attention.sdpa import SdpaAttentionBackend
    from runtime_kernels.attention_backend import TritonAttentionBackend

    spec = AttentionLayerSpec(0, 16, 8, 128, 128**-0.5)
    for backend in (TritonAttentionBackend(), SdpaAttentionBackend()):
        metadata, q, k, v, cache = make_step(requests, 16, 8, 128, 16, torch.bfloat16)
        metadata = backend.build_metadata(metadata)  # once per step, shared by all layers: not timed
        ms = cuda_ms(iters=20, fn=lambda: backend.forward(spec, q, k, v, cache, metadata))
        record(label, backend.name, ms, kv_bytes)
    if all(c == 0 for c, _ in requests):  # dense flash attention, no paging, as a yardstick
        n, q_len = len(requests), requests[0][1]
        q, k = torch.randn(n, 16, q_len, 128, device="cuda").bfloat16(), torch.randn(n, 8, q_len, 128, device="cuda").bfloat16()
        ms = cuda_ms(iters=20, fn=lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
        record(label, "dense sdpa (no paging)", ms, kv_bytes)


def record(label: str, name: str, ms: float, kv_bytes: int) -> None:
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    RESULTS["timings"].append({"case": label, "impl": name, "ms": ms, "kv_read_gb_per_s": gbps})


def time_sampling() -> None:
    from runtime_kernels.sampling import top_k_top_p_filter, top_k_top_p_filter_ref

    logits = torch.randn(256, 151936, device="cuda") * 4
    top_k, top_p = torch.full((256,), 50, device="cuda"), torch.full((256,), 0.9, device="cuda")
    for name, fn in (("partial topk", top_k_top_p_filter), ("full sort (sampler)", top_k_top_p_filter_ref)):
        RESULTS["timings"].append({"case": "top-k 50 + top-p 0.9 [256, 151936]", "impl": name,
                                   "ms": cuda_ms(iters=20, fn=lambda: fn(logits, top_k, top_p)), "kv_read_gb_per_s": None})
    only_p = torch.full((256,), 0.9, device="cuda")
    for name, fn in (("partial topk", top_k_top_p_filter), ("full sort (sampler)", top_k_top_p_filter_ref)):
        RESULTS["timings"].append({"case": "top-p 0.9 [256, 151936]", "impl": name,
                                   "ms": cuda_ms(iters=20, fn=lambda: fn(logits, None, only_p)), "kv_read_gb_per_s": None})


def run_timings() -> None:
    kv_per_token = 2 * 8 * 128 * 2  # k and v, 8 kv heads, head 128, bf16
    time_backends("decode 256 seqs x 1024 ctx", [(1023, 1)] * 256, 256 * 1024 * kv_per_token)
    time_backends("decode 4 seqs x 8192 ctx (split-KV)", [(8191, 1)] * 4, 4 * 8192 * kv_per_token)
    time_backends("prefill 8 x 1024 new tokens", [(0, 1024)] * 8, 8 * 1024 * kv_per_token)
    time_backends("chunked prefill 2 x 512 new on 3584 ctx", [(3584, 512)] * 2, 2 * 4096 * kv_per_token)
    time_backends("mixed: 1 x 512 prefill + 128 decodes x 2048", [(0, 512)] + [(2047, 1)] * 128,
                  (512 + 128 * 2048) * kv_per_token)
    time_sampling()
    log("")
    log("== timings (one layer, 16 q heads / 8 kv heads / head 128, bf16)")
    log(f"  {'case':<46} {'impl':<24} {'ms':>9} {'KV GB/s':>9}")
    for row in RESULTS["timings"]:
        gbps = f"{row['kv_read_gb_per_s']:9.0f}" if row["kv_read_gb_per_s"] else " " * 9
        log(f"  {row['case']:<46} {row['impl']:<24} {row['ms']:9.3f} {gbps}")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_smoke.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    log(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    started = time.time()
    ok = run_checks()
    run_timings()
    log(f"\n{'ALL CHECKS PASSED' if ok else 'SOME CHECKS FAILED'} in {time.time() - started:.0f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu_smoke.log"), "w") as f:
            f.write("\n".join(LINES) + "\n")
        with open(os.path.join(out_dir, "gpu_smoke.json"), "w") as f:
            json.dump(RESULTS, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
