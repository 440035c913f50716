"""Our models give transformers' logits for the same tiny random checkpoints.

Prompts of different lengths run as one flat batch over a paged KV cache with
shuffled blocks; later steps mix decodes with prefill chunks that continue from the
cache. Each of our logits rows is compared with transformers' full forward pass.
"""

from __future__ import annotations

import pytest
import torch
from support.paged_batch import PagedRunner
from runtime.testing.models import TINY_ARCHS, build_tiny_model

from runtime.model_loader import load_model, resolve_model

ATOL = 1e-4
PROMPT_LENS = (5, 13, 21)  # gemma3's window is 8: the longer prompts cross it
# New tokens per request in each step after the prompts: decodes and prefill chunks.
SCHEDULE = ([1, 1, 1], [3, 1, 1], [1, 2, 1], [1, 1, 4])


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(resolve_model(path), dtype=torch.float32, device="cpu")
    return request.param, reference, ours


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def random_tokens(generator: torch.Generator, vocab_size: int, n: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def test_flat_batch_prefill_and_decode_match_transformers(tiny):
    arch, reference, ours = tiny
    vocab_size = reference.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    runner = PagedRunner(ours, num_requests=len(PROMPT_LENS), block_size=4, seed=3)

    prompts = [random_tokens(generator, vocab_size, n) for n in PROMPT_LENS]
    for prompt, logits in zip(prompts, runner.step(prompts)):
        expected = reference_logits(reference, prompt)
        assert expected.abs().max() > 0.05, "logits too small to make the comparison meaningful"
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{arch} prefill")

    for step, q_lens in enumerate(SCHEDULE):
        new = [random_tokens(generator, vocab_size, q) for q in q_lens]
        for i, logits in enumerate(runner.step(new)):
            expected = reference_logits(reference, runner.tokens[i])[-q_lens[i] :]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{arch} step {step} request {i}")


def test_attention_specs_follow_config(tiny):
    arch, reference, ours = tiny
    config = reference.config
    specs = ours.attention_specs()
    assert [s.layer_idx for s in specs] == list(range(config.num_hidden_layers))
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for spec in specs:
        assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (4, 2, head_size)
    if arch == "gemma3":
        assert [s.sliding_window for s in specs] == [8, None, 8, None]
        assert specs[0].scale == pytest.approx(24**-0.5)
    else:
        assert all(s.sliding_window is None for s in specs)
        assert specs[0].scale == pytest.approx(head_size**-0.5)
